"""The entry point of FP8 experts (DeepSeek-V3/R1, Kimi-K2 checkpoints, and `quantization="fp8"`
on a float MoE: layout in fp8_reference.py): fused_fp8_experts, the chosen experts' weighted sum
(plus `shared`).

  - CPU tensors, autograd, or no triton (ops.common.kernel_choice.use_triton): the twin,
    fp8_experts_forward_torch;
  - up to FP8_GEMV_MAX_TOKENS tokens on CUDA (decode, verify, draft) with a power-of-two block
    width: the two FP8 GEMV kernels (fp8_triton_gemv.py), weights read in 8 bits and scaled
    in-kernel, graph-capturable;
  - more tokens on CUDA (prefill): the used experts dequantized to the model dtype (one host
    sync), then the bf16 experts' grouped kernels (dispatch.fused_experts). A grouped kernel on
    FP8 tensor cores that keeps prefill in 8 bits is left to do.

Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.moe.dispatch import fused_experts
from foretell.ops.moe.fp8_reference import check_fp8_experts, dequantize_fp8_experts, fp8_experts_forward_torch

# Up to this many tokens the GEMV kernels run (the int4 path's bound); to be measured on the H200
# at DeepSeek-V3's shapes against the dequantize-then-grouped path.
FP8_GEMV_MAX_TOKENS = 8


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fused_fp8_experts(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H] float8_e4m3fn
    gate_up_scale: torch.Tensor,  # [E, ceil(2I / b0), ceil(H / b1)] float32
    down: torch.Tensor,  # [E, H, I] float8_e4m3fn
    down_scale: torch.Tensor,  # [E, ceil(H / b0), ceil(I / b1)] float32
    block: tuple[int, int],
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    shared: torch.Tensor | None = None,  # [num_tokens, H]: the shared experts' output, added
) -> torch.Tensor:  # [num_tokens, H], hidden's dtype
    tensors = (hidden, gate_up, gate_up_scale, down, down_scale)
    if not use_triton(*tensors):
        out = fp8_experts_forward_torch(hidden, gate_up, gate_up_scale, down, down_scale, block, weights, ids)
        return (out if shared is None else out + shared).to(hidden.dtype)
    # Past the bound the dequantizing path reads the used experts' ids on the host: not while a
    # CUDA graph is captured (verify steps of larger batches), where the GEMV path runs instead.
    gemv = hidden.shape[0] <= FP8_GEMV_MAX_TOKENS or torch.cuda.is_current_stream_capturing()
    if gemv and _power_of_two(block[1]):
        from foretell.ops.moe.fp8_triton_gemv import fused_fp8_experts_gemv_triton  # imports triton

        return fused_fp8_experts_gemv_triton(hidden, gate_up, gate_up_scale, down, down_scale, block, weights, ids,
                                             shared, out_dtype=hidden.dtype)
    check_fp8_experts(hidden, gate_up, gate_up_scale, down, down_scale, block, weights, ids, shared)
    used, compact_ids = torch.unique(ids, return_inverse=True)
    w_gate_up = dequantize_fp8_experts(gate_up[used], gate_up_scale[used], block, hidden.dtype)  # [U, 2I, H]
    w_down = dequantize_fp8_experts(down[used], down_scale[used], block, hidden.dtype)  # [U, H, I]
    return fused_experts(hidden, w_gate_up, w_down, weights, compact_ids, shared)
