"""Mixture of experts of the batch-invariant mode on CUDA (issue 23): the grouped kernels of
triton_experts.py launched with one tile shape for every batch, so that a token's output depends on
its own hidden row, routing and the weights only. Sync-free, so a step with MoE layers is captured in
CUDA graphs (the torch form in batch_invariant.py reads the expert counts on the host every layer).

What makes the default launch batch-dependent, and what is fixed here:
  - the path: up to GEMV_MAX_TOKENS tokens the GEMV kernels run (split-K slots, their own sum
    order), above them the grouped tensor-core kernels: here always the grouped ones;
  - the tiles: moe_launch_config picks BLOCK_M (pairs per tile: 16 .. 64, and with it mma.sync or
    wgmma) and BLOCK_K from the mean pairs per expert: here fixed per dtype (FIXED_TILES).
With those fixed, every (token, slot) pair's products are sums over the same BLOCK_K chunks of K in
the same order, each chunk one tensor-core dot of a fixed instruction shape, whichever tile slot the
pair sits in and whatever pairs share its tile (a GPU's MMA treats the rows of a tile alike:
tests/gpu/test_batch_invariant_gpu.py checks it bitwise at 1..64 tokens); the pair's expert output
is rounded to the model dtype and weighted in float32 at its own row (no atomics); the combine adds
a token's slots in slot order 0, 1, ..., top_k - 1, then `shared`, in float32, and rounds once.
The grouping (which pairs share a tile, in which slot) is built on the device (the align kernel or
its torch twin: the choice by size changes placement only, never a pair's bits). Grids are fixed by
the number of pairs: nothing reads a device value on the host.

The contract is batch_invariant.experts_forward_batch_invariant's (same rounding points; the
silu runs in float32 here, in float64 there: the two agree within rounding, not bitwise).
tests/ops/test_batch_invariant_moe.py runs it in Triton's interpreter (float16 / float32).
"""

from __future__ import annotations

import torch

from foretell.ops.moe.triton_experts import fused_experts_triton

# One launch shape for every batch: (BLOCK_M pairs, BLOCK_N columns, BLOCK_K of the reduction).
# 16-bit: the decode config of moe_launch_config (near the best of the H200 sweeps at 1-16 tokens);
# float32 takes the FMA path with small tiles, as there.
FIXED_TILES = {
    2: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    4: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
}


def batch_invariant_tiles(dtype: torch.dtype) -> dict:
    """The mode's fixed launch config for experts of `dtype` (bf16 / fp16 / fp32)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the batch-invariant MoE kernels take bf16, fp16 or fp32 experts, got {dtype}")
    return dict(FIXED_TILES[dtype.itemsize])


def experts_forward_batch_invariant_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, k] float32
    ids: torch.Tensor,  # [num_tokens, k] int
    shared: torch.Tensor | None = None,  # [num_tokens, hidden]: added after the experts
    align_kernel: bool | None = None,  # None: by size (triton_experts.ALIGN_KERNEL_MAX_PAIRS); tests force it
) -> torch.Tensor:  # [num_tokens, hidden], hidden's dtype
    if weights.shape != ids.shape:
        raise ValueError(f"weights and ids must have one shape [num_tokens, k], got {list(weights.shape)} "
                         f"and {list(ids.shape)}")
    return fused_experts_triton(hidden, gate_up, down, weights, ids, config=batch_invariant_tiles(gate_up.dtype),
                                align_kernel=align_kernel, shared=shared, out_dtype=hidden.dtype, path="grouped")
