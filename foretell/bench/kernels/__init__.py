"""The public kernel benchmarking API (`foretell bench kernels` is built on it):

  timing.py       time_kernel(fn, device, warmup=, iters=, calls_per_run=, cuda_graph=, flush_l2_bytes=)
                  -> KernelTiming (median / min / max us per call; gb_per_s(bytes), tflops(flops))
  inputs.py       random inputs from shapes and a dtype: paged_attention_inputs, latent_attention_inputs,
                  expert_inputs, int4_expert_inputs, linear_weight, fp8_block_weight
  cases.py        KernelCase / KernelPath, the presets and model shapes; attention and MLA cases
  cases_linear.py MoE (bf16, int4), few-row GEMM, FP8 linear, the per-row layer ops
  run.py          KERNELS (name -> case builder), run_kernel_bench, run_case, format_rows
  command.py      the `foretell bench kernels` flags (cheap to import)
  linear_chain.py a decode step's chain of one-row linears (every layer's weights) in one CUDA graph,
                  swept per layer kind (scripts/sweep_linears_in_graph_gpu.py); linear_kinds.py its
                  fp8 / bf16 / batch-invariant families; moe_int4_chain.py the int4 MoE GEMV likewise

Scripts time a kernel with these instead of reaching into tests/ or the runner. Importing this
package loads nothing heavy; import the submodules.
"""
