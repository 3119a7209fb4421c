"""The entry point of FP8 experts (DeepSeek-V3/R1, Kimi-K2 checkpoints, and `quantization="fp8"`
on a float MoE: layout in fp8_reference.py): fused_fp8_experts, the chosen experts' weighted sum
(plus `shared`).

  - CPU tensors, autograd, or no triton (ops.common.kernel_choice.use_triton): the twin,
    fp8_experts_forward_torch;
  - up to FP8_GEMV_MAX_TOKENS tokens on CUDA (decode, verify, draft) with a power-of-two block
    width: the two FP8 GEMV kernels (fp8_triton_gemv.py), weights read in 8 bits and scaled
    in-kernel, graph-capturable;
  - more tokens on CUDA (prefill): the used experts dequantized to the model dtype a chunk at a
    time (dequantized_chunks.py: bounded memory; host syncs), each chunk's pairs through the bf16
    grouped kernels (triton_experts.py). A grouped kernel on FP8 tensor cores that keeps prefill
    in 8 bits is left to do.

Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.moe.dequantized_chunks import experts_in_chunks, experts_per_chunk
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
    from foretell.ops.moe.triton_experts import fused_experts_triton  # imports triton

    def dequantize(used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_fp8_experts(gate_up[used], gate_up_scale[used], block, hidden.dtype),  # [U, 2I, H]
                dequantize_fp8_experts(down[used], down_scale[used], block, hidden.dtype))  # [U, H, I]

    def grouped(x, w_gate_up, w_down, pair_weights, pair_ids):  # [P, H] float32
        return fused_experts_triton(x, w_gate_up, w_down, pair_weights, pair_ids, out_dtype=torch.float32)

    # the dequantization passes through float32 (4 bytes an element) before it rounds to hidden's dtype
    per_expert = (gate_up[0].numel() + down[0].numel()) * (4 + hidden.dtype.itemsize)
    out = experts_in_chunks(hidden, weights, ids, dequantize, grouped, experts_per_chunk(per_expert))
    return (out if shared is None else out + shared).to(hidden.dtype)
