"""The entry point of int4 experts (Kimi-K2.5's routed experts, compressed-tensors pack-quantized
layout: int4_reference.py): fused_int4_experts, the chosen experts' weighted sum (plus `shared`).

  - CPU tensors, autograd, or no triton (ops.common.kernel_choice.use_triton): the twin,
    int4_experts_forward_torch;
  - up to INT4_GEMV_MAX_TOKENS tokens on CUDA (decode, verify): the two int4 GEMV kernels
    (triton_int4_gemv.py), the packed words unpacked and scaled in-kernel, graph-capturable;
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
    # (the dequantizing path below reads ids on the host: never while a CUDA graph is captured)
    if hidden.shape[0] <= INT4_GEMV_MAX_TOKENS or torch.cuda.is_current_stream_capturing():
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
