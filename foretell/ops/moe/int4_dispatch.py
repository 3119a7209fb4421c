"""The entry point of int4 experts (Kimi-K2.5's routed experts, compressed-tensors pack-quantized
layout: int4_reference.py): fused_int4_experts, the chosen experts' weighted sum (plus `shared`).

  - CPU tensors, autograd, or no triton (ops.common.kernel_choice.use_triton): the twin,
    int4_experts_forward_torch;
  - then int4_decode_kernel's rule, on the step's token count, the scales' dtype and the GPU:
    up to INT4_MMA_MAX_TOKENS tokens with fp16 / bf16 scales on sm_80 or newer (decode, verify):
    the tensor-core kernels (triton_int4_mma.py: words decoded in registers, token rows padded
    to 16, split-K to fill the SMs), graph-capturable;
  - otherwise up to INT4_GEMV_MAX_TOKENS tokens (float32 scales, whose tl.dot would round to
    tf32; older GPUs): the two int4 GEMV kernels (triton_int4_gemv.py), graph-capturable;
  - more tokens on CUDA (prefill): the used experts dequantized to the scales' dtype a chunk at a
    time (dequantized_chunks.py: at most DEQUANTIZED_CHUNK_BYTES at once; host syncs), each chunk's
    pairs through the bf16 grouped kernels (triton_experts.py). A grouped int4 kernel that keeps
    prefill in 4 bits is left to do.

Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.moe.dequantized_chunks import experts_in_chunks, experts_per_chunk
from foretell.ops.moe.int4_reference import check_int4_expert_inputs, dequantize_int4, int4_experts_forward_torch

# Up to this many tokens the GEMV kernels run (as the bf16 path's GEMV_MAX_TOKENS); to be measured
# on the H200 at Kimi-K2.5's shapes against the dequantize-then-grouped path.
INT4_GEMV_MAX_TOKENS = 8
# Up to this many tokens the tensor-core kernels run: one MMA of 16 token rows per expert holds a
# whole step of 16 tokens (more take row chunks, each reading the expert's words again). Chosen
# by design (the GEMV read 20.5% of the H200's bandwidth at Kimi-K2.5's shapes); to be confirmed
# on the H200 (scripts/check_low_precision_gpu.py int4_moe_bandwidth times both).
INT4_MMA_MAX_TOKENS = 16
MMA_SCALE_DTYPES = (torch.float16, torch.bfloat16)


def int4_decode_kernel(
    num_tokens: int,
    device: torch.device,
    scale_dtype: torch.dtype,
    capability: tuple[int, int] | None,  # the CUDA device's compute capability (None off CUDA)
) -> str:  # "torch" | "mma" | "gemv" | "dequantized"
    """Which int4 experts path a step of num_tokens takes (the rule fused_int4_experts follows once
    use_triton has said yes): "mma" (triton_int4_mma.py), "gemv" (triton_int4_gemv.py), or
    "dequantized" (the used experts dequantized in chunks, then the bf16 grouped kernels)."""
    if device.type != "cuda" or capability is None:
        return "torch"
    if num_tokens <= INT4_MMA_MAX_TOKENS and scale_dtype in MMA_SCALE_DTYPES and tuple(capability) >= (8, 0):
        return "mma"
    return "gemv" if num_tokens <= INT4_GEMV_MAX_TOKENS else "dequantized"


def fused_int4_experts(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up_packed: torch.Tensor,  # [E, 2 * I, ceil(H / 8)] int32
    gate_up_scale: torch.Tensor,  # [E, 2 * I, ceil(H / 32)]
    down_packed: torch.Tensor,  # [E, H, ceil(I / 8)] int32
    down_scale: torch.Tensor,  # [E, H, ceil(I / 32)]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    shared: torch.Tensor | None = None,  # [num_tokens, H]: the shared experts' output, added
) -> torch.Tensor:  # [num_tokens, H], hidden's dtype
    tensors = (hidden, gate_up_packed, gate_up_scale, down_packed, down_scale)
    if not use_triton(*tensors):
        out = int4_experts_forward_torch(hidden, gate_up_packed, gate_up_scale, down_packed, down_scale, weights, ids)
        return (out if shared is None else out + shared).to(hidden.dtype)
    kernel = int4_decode_kernel(hidden.shape[0], hidden.device, gate_up_scale.dtype,
                                torch.cuda.get_device_capability(hidden.device))
    if kernel == "mma":
        from foretell.ops.moe.triton_int4_mma import fused_int4_experts_mma_triton  # imports triton

        return fused_int4_experts_mma_triton(hidden, gate_up_packed, gate_up_scale, down_packed, down_scale,
                                             weights, ids, shared, out_dtype=hidden.dtype)
    # (the dequantizing path below reads ids on the host: never while a CUDA graph is captured)
    if kernel == "gemv" or torch.cuda.is_current_stream_capturing():
        from foretell.ops.moe.triton_int4_gemv import fused_int4_experts_gemv_triton  # imports triton

        return fused_int4_experts_gemv_triton(hidden, gate_up_packed, gate_up_scale, down_packed, down_scale,
                                              weights, ids, shared, out_dtype=hidden.dtype)
    check_int4_expert_inputs(hidden, gate_up_packed, gate_up_scale, down_packed, down_scale, weights, ids, shared)
    from foretell.ops.moe.triton_experts import fused_experts_triton  # imports triton

    hidden_size, inter = hidden.shape[-1], gate_up_packed.shape[1] // 2
    dtype = gate_up_scale.dtype

    def dequantize(used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_int4(gate_up_packed[used], gate_up_scale[used], hidden_size),  # [U, 2I, H]
                dequantize_int4(down_packed[used], down_scale[used], inter))  # [U, H, I]

    def grouped(x, gate_up, down, pair_weights, pair_ids):  # [P, H] float32
        return fused_experts_triton(x, gate_up, down, pair_weights, pair_ids, out_dtype=torch.float32)

    per_expert = 3 * hidden_size * inter * dtype.itemsize
    out = experts_in_chunks(hidden.to(dtype), weights, ids, dequantize, grouped, experts_per_chunk(per_expert))
    return (out if shared is None else out + shared).to(hidden.dtype)
