"""The entry point of int4 experts (Kimi-K2.5's routed experts, compressed-tensors pack-quantized
layout: int4_reference.py): fused_int4_experts, the chosen experts' weighted sum (plus `shared`).

  - CPU tensors, autograd, or no triton (ops.common.kernel_choice.use_triton): the twin,
    int4_experts_forward_torch;
  - up to INT4_GEMV_MAX_TOKENS tokens on CUDA (decode, verify): the two int4 GEMV kernels
    (triton_int4_gemv.py), the packed words unpacked and scaled in-kernel, graph-capturable;
  - more tokens on CUDA (prefill): the used experts dequantized to the scales' dtype (one host
    sync), then the bf16 experts' dispatch (dispatch.fused_experts). A grouped int4 kernel that
    keeps prefill in 4 bits is left to do.

Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.moe.dispatch import fused_experts
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
    used, compact_ids = torch.unique(ids, return_inverse=True)
    gate_up = dequantize_int4(gate_up_packed[used], gate_up_scale[used], hidden.shape[-1])  # [U, 2I, H]
    down = dequantize_int4(down_packed[used], down_scale[used], gate_up_packed.shape[1] // 2)  # [U, H, I]
    return fused_experts(hidden.to(gate_up.dtype), gate_up, down, weights, compact_ids, shared).to(hidden.dtype)
