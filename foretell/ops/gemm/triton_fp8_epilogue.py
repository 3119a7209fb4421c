"""The FP8 few-row kernels' epilogue (triton_fp8_few_rows.py's GEMV and MMA, triton_fp8_gemv_half.py):
a program's float32 sums [BLOCK_N rows of W, BLOCK_X rows of x] to the output, with per-channel
scales, bias, rounding to x's dtype and silu(gate) * up for a gated product; with split-K, each split
stores its partial and the split that arrives last at its tile's counter (acquire-release) sums the
partials in split order (the same result whichever finished first), finishes and zeroes the counter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from foretell.ops.gemm.triton_mma import store_output


@triton.jit
def finish(acc, scale_ptr, stride_scale, bias_ptr, out_ptr, rows_w, w_ok, rows_x, x_ok, tile, N,
           PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr, dtype: tl.constexpr):
    """acc [BLOCK_N, BLOCK_X] (rows of W x rows of x, summed over K) -> out[rows_x, ...]: per-channel
    scales, bias, rounding to dtype (x's); GATED: silu(gate) * up per (gate j, up j) pair of rows,
    stored as out [M, N // 2]."""
    if PER_CHANNEL:
        acc *= tl.load(scale_ptr + rows_w * stride_scale, mask=w_ok, other=0.0)[:, None]
    store_output(acc, bias_ptr, rows_w, w_ok, out_ptr, rows_x, x_ok, tile, N, HAS_BIAS, GATED, BLOCK_N, BLOCK_X, dtype)


@triton.jit
def finish_split(acc, partial_ptr, counter_ptr, scale_ptr, stride_scale, bias_ptr, out_ptr, rows_w, w_ok,
                 rows_x, x_ok, tile, split, M, N,
                 PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr, dtype: tl.constexpr):
    """finish, after the splits of the tile are summed: each stores its float32 partial
    [BLOCK_N, BLOCK_X]; the last to arrive sums them in split order and finishes."""
    if SPLIT == 1:
        finish(acc, scale_ptr, stride_scale, bias_ptr, out_ptr, rows_w, w_ok, rows_x, x_ok, tile, N,
                PER_CHANNEL, HAS_BIAS, GATED, BLOCK_N, BLOCK_X, dtype)
    else:
        offsets = rows_x[None, :] * N + rows_w[:, None]  # [BLOCK_N, BLOCK_X] in a [M, N] partial
        mask = w_ok[:, None] & x_ok[None, :]
        tl.store(partial_ptr + split * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last split of this tile: every partial is visible now
            total = tl.zeros_like(acc)
            for s in range(SPLIT):  # split order: the same sum whichever split finished last
                total += tl.load(partial_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            finish(total, scale_ptr, stride_scale, bias_ptr, out_ptr, rows_w, w_ok, rows_x, x_ok, tile, N,
                    PER_CHANNEL, HAS_BIAS, GATED, BLOCK_N, BLOCK_X, dtype)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch
