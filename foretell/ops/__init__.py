"""The operations the models run, one folder per operation, each with its plain-torch reference,
its Triton kernels and the entry point the layers call. layers/ holds the nn.Modules (weights,
checkpoint names) and calls in here; ops import nothing of the package above them (layers, models,
runner, spec_decode, engine): what an op needs from a module is named in common/protocols.py.

Folders:
  attention/   paged GQA attention: metadata (AttentionMetadata), KV write, varlen attention,
               RoPE + KV write, RoPE + attention in one launch, and the backends over them
  mla/         multi-head latent attention over the latent cache (DeepSeek, Kimi)
  moe/         router (expert selection) and the packed experts' forward
  gemm/        few-row GEMMs (GEMV, tensor-core MMA) and SmallMGemm, which picks them or cuBLAS
  pointwise/   per-row ops of a decoder layer: residual add + RMSNorm, RoPE, SiLU-and-mul, the
               EAGLE3 draft layer's input (embedding rows + two norms)
  sampling/    row-wise argmax over a large vocabulary
  step/        a speculative step's bookkeeping: graph inputs from one packed upload, greedy and
               drawn acceptance, the draft loop's catch-up inputs, the next verify's inputs
  common/      what the others share: kernel_choice (may this call use Triton?), pdl (dependent
               launches), split_counters, protocols

Names inside a folder (one convention everywhere):
  reference.py      the plain-torch twins: what the CPU runs and what the kernels are held to
                    (tests/ops/ holds each kernel and its twin together on random inputs)
  triton_<what>.py  @triton.jit kernels and their launchers; these import triton at the top, so
                    only dispatch code (and other triton_ files) import them, lazily, on CUDA:
                    a CPU-only install never loads triton
  dispatch.py       the entry points layers call: the Triton path where
                    common.kernel_choice.use_triton allows (CUDA tensors, triton importable, no
                    autograd), else the reference
  other names       plain data an op takes (attention/metadata.py)
Where a module owns the state an op reads (RMSNorm's weight, RotaryEmbedding's cos/sin tables),
that module keeps its torch path and asks kernel_choice itself.
"""
