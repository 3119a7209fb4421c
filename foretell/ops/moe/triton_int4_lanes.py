"""The int4 MoE kernels' weight loops over x's lanes prepared once per token: what
triton_int4_gemv.py's two kernels run by default (launch config "LANES"; read that module's
docstring first for the format and the nibble arithmetic).

Why: with LANES off the kernels compute x's eight lanes and the words' correction c (_x_lanes) in
every program and every tile, for the few rows a thread holds, move them into the weight tile's
layout through shared memory (a barrier pair per lane) and read each group's scale once per
word: ~39 sm_90 instructions a packed word (gate_up, 8 x 512 on two warps, compiled as the device
launches it, pointers and sizes divisible by 16), against ~20 for the nibbles' arithmetic itself.
Here (28.6 a word at the default 4 x 512 on one warp; the H200's figures in docs/perf-log.md,
2026-12-04):
  - _int4_x_lanes_kernel writes, once per token (or per (token, expert) pair for the down
    kernel's act), lanes [rows, 9, words] float32: lane i (0..7) holds x[8 j + i] (rounded to the
    scales' dtype) times 2^8 (even i) or 2^4 (odd i), lane 8 the correction c_j = sum_i (2^8 or
    2^4 + 8) x[8 j + i]: _x_lanes' values, each lane contiguous along the words, padded with zeros
    to whole tiles so the kernels read them unmasked;
  - the weight loops read [BLOCK_N, G, 4] tiles (G groups of four packed words: a group of 32
    columns shares one scale) and the lanes at the same [BLOCK_N, G, 4] shape, the same addresses
    for every row, so the lanes arrive in the tile's own layout (no shared memory, no barrier) and
    gate_up reads them once for its gate and up rows; a word's 8 products are chained onto -c,
    the group's four words summed in the thread, and the group times its scale (read once a
    group) added to the row's accumulator;
  - 1.0's bits come in as a runtime value (FLOAT_ONE_BITS): as a literal, ptxas rematerialized
    the two nibble masks in registers before every use (~4 instructions a word).
The arithmetic is _nibble_pair's; the sums are the LANES-off kernels' up to the order of float32
additions (per group instead of per word lane), so the output matches the twin as those do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


NUM_LANES = 9  # x's eight nibble lanes and the words' correction c
FLOAT_ONE_BITS = 0x3F800000  # 1.0's float32 bits, the nibble floats' exponent
LANES_BLOCK = 256  # words a program of the lanes kernel


@triton.jit
def _int4_x_lanes_kernel(
    x_ptr,  # [num_tokens, K]
    lanes_ptr,  # [num_tokens, 9, lane_words] float32 out
    K,
    stride_x,
    lane_words,  # ceil(K / 8) padded to whole tiles (the words past K get zero lanes)
    DTYPE: tl.constexpr,  # the scales' dtype: x is rounded to it first, as the bf16 kernels feed x
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x_row = x_ptr + token * stride_x
    out = lanes_ptr + token * 9 * lane_words + word
    valid = word < lane_words
    c = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(8):
        x = tl.load(x_row + word * 8 + i, mask=word * 8 + i < K, other=0.0).to(DTYPE).to(tl.float32)
        lane = x * (16.0 + 240.0 * ((i + 1) % 2))  # x * 2^8 (even i) or x * 2^4 (odd i), exactly
        tl.store(out + i * lane_words, lane, mask=valid)
        c += lane + 8.0 * x
    tl.store(out + 8 * lane_words, c, mask=valid)


@triton.jit
def _tile_lanes(lane_row_ptr, w0, num_words, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """The 9 lanes of the tile's words w0 .. w0 + 4 G at the tile's [BLOCK_N, G, 4] shape (every
    row reads the same addresses, so the values arrive in the weight tile's layout; the lanes
    buffer is padded to whole tiles, so no mask)."""
    no_rows = tl.zeros([BLOCK_N, 1, 1], tl.int32)
    word = w0 + tl.arange(0, G)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :] + no_rows  # [BLOCK_N, G, 4]
    lane = lane_row_ptr + word
    return (tl.load(lane), tl.load(lane + num_words), tl.load(lane + 2 * num_words), tl.load(lane + 3 * num_words),
            tl.load(lane + 4 * num_words), tl.load(lane + 5 * num_words), tl.load(lane + 6 * num_words),
            tl.load(lane + 7 * num_words), tl.load(lane + 8 * num_words), word)


@triton.jit
def _int4_group_sums(packed_rows, scale_rows, word, row_valid, num_words, num_groups, x0, x1, x2, x3, x4, x5, x6, x7,
                     c, one, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """scale * sum over each group's 32 columns of (q - 8) * x for the tile's words word [BLOCK_N,
    G, 4], [BLOCK_N, G] float32. packed_rows / scale_rows [BLOCK_N, 1, 1]: the rows' packed words
    and scales; row_valid [BLOCK_N, 1, 1]."""
    packed = tl.load(packed_rows + word, mask=row_valid & (word < num_words), other=0,
                     eviction_policy="evict_first")  # [BLOCK_N, G, 4] int32
    sums = _nibble_pair3(-c, packed, 15, x0, x1, one)
    sums = _nibble_pair3(sums, packed, 7, x2, x3, one)
    sums = _nibble_pair3(sums, packed, -1, x4, x5, one)
    sums = _nibble_pair3(sums, packed, -9, x6, x7, one)
    group = tl.min(word, axis=2) // 4  # [BLOCK_N, G]: each group's first word / 4
    scales = tl.load(tl.reshape(scale_rows, [BLOCK_N, 1]) + group,
                     mask=tl.reshape(row_valid, [BLOCK_N, 1]) & (group < num_groups), other=0.0).to(tl.float32)
    return tl.sum(sums, axis=2) * scales


@triton.jit
def _nibble_pair3(sums, packed, shift: tl.constexpr, x_even, x_odd, one):
    """_nibble_pair with the lanes already at the tile's shape (no broadcast)."""
    if shift >= 0:
        moved = packed << shift
    else:
        moved = packed >> (-shift)
    f_odd = ((moved & 0x00780000) | one).to(tl.float32, bitcast=True)
    f_even = ((moved & 0x00078000) | one).to(tl.float32, bitcast=True)
    return sums + f_even * x_even + f_odd * x_odd


@triton.jit
def _lanes_gate_up_sums(packed_ptr, scale_ptr, lanes_ptr, expert, token, cols, col_valid, inter, stride_packed_expert,
                        stride_scale_expert, num_words, num_groups, lanes_words, one,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 gate and up projections [BLOCK_N] of rows cols of the expert for the token,
    each tile's lanes read once for both."""
    G: tl.constexpr = BLOCK_K // 32
    rows3 = cols[:, None, None].to(tl.int64)  # [BLOCK_N, 1, 1]
    valid3 = col_valid[:, None, None]
    gate_packed = packed_ptr + expert * stride_packed_expert + rows3 * num_words
    up_packed = packed_ptr + expert * stride_packed_expert + (rows3 + inter) * num_words
    gate_scales = scale_ptr + expert * stride_scale_expert + rows3 * num_groups
    up_scales = scale_ptr + expert * stride_scale_expert + (rows3 + inter) * num_groups
    lane_row = lanes_ptr + token * 9 * lanes_words
    gate = tl.zeros([BLOCK_N, G], dtype=tl.float32)  # per row and group slot: summed once, after
    up = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_K // 8):
        x0, x1, x2, x3, x4, x5, x6, x7, c, word = _tile_lanes(lane_row, w0, lanes_words, BLOCK_N, G)
        gate += _int4_group_sums(gate_packed, gate_scales, word, valid3, num_words, num_groups, x0, x1, x2, x3, x4,
                                 x5, x6, x7, c, one, BLOCK_N, G)
        up += _int4_group_sums(up_packed, up_scales, word, valid3, num_words, num_groups, x0, x1, x2, x3, x4, x5, x6,
                               x7, c, one, BLOCK_N, G)
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _lanes_row_sums(packed_ptr, scale_ptr, lanes_ptr, expert, pair, cols, col_valid, stride_packed_expert,
                    stride_scale_expert, num_words, num_groups, lanes_words, one,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 products [BLOCK_N] of rows cols of the expert with the pair's lanes (down)."""
    G: tl.constexpr = BLOCK_K // 32
    rows3 = cols[:, None, None].to(tl.int64)  # [BLOCK_N, 1, 1]
    rows_packed = packed_ptr + expert * stride_packed_expert + rows3 * num_words
    rows_scale = scale_ptr + expert * stride_scale_expert + rows3 * num_groups
    lane_row = lanes_ptr + pair.to(tl.int64) * 9 * lanes_words
    y = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_K // 8):
        x0, x1, x2, x3, x4, x5, x6, x7, c, word = _tile_lanes(lane_row, w0, lanes_words, BLOCK_N, G)
        y += _int4_group_sums(rows_packed, rows_scale, word, col_valid[:, None, None], num_words, num_groups, x0, x1,
                              x2, x3, x4, x5, x6, x7, c, one, BLOCK_N, G)
    return tl.sum(y, axis=1)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def x_lanes(hidden: torch.Tensor, dtype: torch.dtype, tile_words: int) -> torch.Tensor:  # [T, 9, W] float32
    """The lanes of x [num_tokens, K] (rounded to dtype first), W = ceil(K / 8) words padded with
    zeros to whole tiles of tile_words (the kernels read whole tiles of lanes unmasked)."""
    num_tokens, k = hidden.shape
    num_words = -(-k // 8)
    padded = triton.cdiv(num_words, tile_words) * tile_words
    lanes = torch.empty(num_tokens, NUM_LANES, padded, dtype=torch.float32, device=hidden.device)
    _int4_x_lanes_kernel[(num_tokens, triton.cdiv(padded, LANES_BLOCK))](  # the padding's zeros written too
        hidden, lanes, k, hidden.stride(0), padded, DTYPE=_TL_DTYPES[dtype], BLOCK=LANES_BLOCK)
    return lanes
