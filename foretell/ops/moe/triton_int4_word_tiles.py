"""The "word_tiles" variant of the int4 MoE GEMV kernels (triton_int4_gemv.py's docstring has the
format, the grids, the slot split and the roundings; this file owns only how a tile is read).

triton_int4_gemv.py's kernels ("nibble_lanes") load x once a tile as 8 one-dimensional vectors
[BLOCK_K / 8] (column 8 j + i for nibble i) and broadcast them against the [BLOCK_N, BLOCK_K / 8]
tile of packed words. A 1-D vector has its own layout, not the tile's, so for sm_90 every tile
moves x's 9 vectors (8 lanes and the words' correction) through shared memory with barriers:
the sixteenth GPU session's reading of why that loop stays at ~20% of the H200's bandwidth at
Kimi-K2.5's shapes (docs/perf-log.md).

Here x is loaded in the tile's own shape: nibble i's lane is a [BLOCK_N, BLOCK_K / 8] load of
x[k0 + 8 j + i] with every row at the same address (the FP8 GEMV's 3fbaea0 trick), so it takes the
words' layout, the compiler keeps one load per distinct address a thread holds (its rows share
them) and nothing passes through shared memory. When K is whole tiles (EVEN_K: every Kimi-K2.5
shape) nothing in the loop is masked: rows past N are clamped to the last real row instead (their
results are never stored), as a masked broadcast load is not merged. Two more instructions a
weight's worth saved in the loop: the nibbles become 16 + q / 16 and 1 + q / 16 (the exponents of
16.0 and 1.0) instead of 1 + q / 256 and 1 + q / 16, so x's lanes need no scaling multiply and
the 16 goes into the word's scale, and the exponents are kept in registers (_int4_word_tile).
Every value is triton_int4_gemv.py's divided by 16 (a power of two: the same roundings), the
correction, the scale and the single sum across word lanes as there, so the two variants give the
same bits wherever the compiler contracts them alike (Triton's interpreter: always;
tests/ops/test_moe_int4_word_tiles.py). sm_90 loop at Kimi-K2.5's gate_up, 16 x 1024 tiles over
4 warps: 3.56 instructions an int4 weight, no barrier, no shared memory (the lanes kernel: 5.62
at its 4 x 1024 default, 18 barriers; scripts/count_int4_gemv_sass.py).

Selected per kernel by the launch config's "variant" key (triton_int4_gemv.INT4_VARIANTS); the
launch function stays fused_int4_experts_gemv_triton. Imports triton: CUDA or the interpreter only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from foretell.ops.moe.gemv_common import (
    _combine_split_slots,
    _down_program,
    _store_silu_product,
    _store_token,
    _zero_counters,
)


@triton.jit
def _x_lane_tile(x_row_ptr, lane_offsets, K, i: tl.constexpr, dtype: tl.constexpr, EVEN_K: tl.constexpr):
    """x[8 j + i] at every row of the tile [BLOCK_N, WORDS] (lane_offsets = 8 j, the same in each
    row), read in dtype as a float32."""
    if EVEN_K:
        x = tl.load(x_row_ptr + lane_offsets + i)
    else:
        x = tl.load(x_row_ptr + lane_offsets + i, mask=lane_offsets + i < K, other=0.0)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _nibble_pair_sixteenths(sums, packed, shift: tl.constexpr, x_even, x_odd, one, sixteen):
    """sums + f_even x_even + f_odd x_odd for the byte of packed at bits 8 k .. 8 k + 7 (shift = 15 -
    8 k; negative: to the right), with f_even = 16 + q_even / 16 and f_odd = 1 + q_odd / 16 made
    from their bits: the byte moved so its high nibble fills the float mantissa's top 4 bits and its
    low nibble the next 4, each masked into the bits of 1.0 (odd: `one`) or 16.0 (even: `sixteen`),
    one LOP3 a nibble (the two exponents come in registers: _int4_word_tile says why). Exactly
    triton_int4_gemv._nibble_pair's f_i x'_i divided by 16 (it scales x's lanes by 256 and 16
    instead, a multiply a lane that this form leaves out): every sum is that kernel's / 16."""
    if shift >= 0:
        moved = packed << shift
    else:
        moved = packed >> (-shift)
    f_odd = ((moved & 0x00780000) | one).to(tl.float32, bitcast=True)  # 1 + q / 16
    f_even = ((moved & 0x00078000) | sixteen).to(tl.float32, bitcast=True)  # 16 + q / 16
    return sums + f_even * x_even + f_odd * x_odd


@triton.jit
def _int4_word_tile(packed_rows, scale_rows, x_row_ptr, k0, K, num_words, num_groups, rows_zero,
                    BLOCK_K: tl.constexpr, dtype: tl.constexpr, EVEN_K: tl.constexpr):
    """scale * sum over each word's 8 nibbles of (q - 8) * x, [BLOCK_N, BLOCK_K / 8] float32, for the
    tile at columns k0 .. k0 + BLOCK_K. packed_rows / scale_rows [BLOCK_N, 1]: the rows' packed
    words and scales (rows already clamped to real ones); rows_zero [BLOCK_N, 1] int32 zeros that
    give x's loads the tile's shape. With f_i from _nibble_pair_sixteenths, sum_i f_i x_i - c =
    sum_i (q_i - 8) x_i / 16 for c = sum_i (16 or 1 + 1 / 2) x_i, so the scale is taken times 16:
    triton_int4_gemv._int4_words' values and roundings, all its sums / 16 (powers of two: exact)."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [WORDS]
    group = word // 4  # 32 columns a scale: 4 words
    lane_offsets = word[None, :] * 8 + rows_zero  # [BLOCK_N, WORDS]: 8 j in every row
    if EVEN_K:
        packed = tl.load(packed_rows + word[None, :], eviction_policy="evict_first")  # [BLOCK_N, WORDS] int32
        scales = tl.load(scale_rows + group[None, :])  # [BLOCK_N, WORDS]
    else:
        packed = tl.load(packed_rows + word[None, :], mask=(word < num_words)[None, :], other=0,
                         eviction_policy="evict_first")
        scales = tl.load(scale_rows + group[None, :], mask=(group < num_groups)[None, :], other=0.0)
    x0 = _x_lane_tile(x_row_ptr, lane_offsets, K, 0, dtype, EVEN_K)
    x1 = _x_lane_tile(x_row_ptr, lane_offsets, K, 1, dtype, EVEN_K)
    x2 = _x_lane_tile(x_row_ptr, lane_offsets, K, 2, dtype, EVEN_K)
    x3 = _x_lane_tile(x_row_ptr, lane_offsets, K, 3, dtype, EVEN_K)
    x4 = _x_lane_tile(x_row_ptr, lane_offsets, K, 4, dtype, EVEN_K)
    x5 = _x_lane_tile(x_row_ptr, lane_offsets, K, 5, dtype, EVEN_K)
    x6 = _x_lane_tile(x_row_ptr, lane_offsets, K, 6, dtype, EVEN_K)
    x7 = _x_lane_tile(x_row_ptr, lane_offsets, K, 7, dtype, EVEN_K)
    c = 16.5 * ((x0 + x2) + (x4 + x6)) + 1.5 * ((x1 + x3) + (x5 + x7))  # [BLOCK_N, WORDS]
    # 1.0's and 16.0's bits as values no compiler sees as constants (num_words >> 31 is 0 for any
    # real row): with both masks and both exponents immediates, ptxas put a mask in a register by a MOV
    # before nearly every LOP3 (sm_90, 16 x 1024 tile: 204 MOVs, 0.8 an int4 weight; none this way).
    # An add, not an OR: LLVM reassociates (a & m) | (k | 0) and splits the LOP3 in two.
    opaque_zero = num_words >> 31
    one = 0x3F800000 + opaque_zero
    sixteen = 0x41800000 + opaque_zero
    sums = _nibble_pair_sixteenths(-c, packed, 15, x0, x1, one, sixteen)
    sums = _nibble_pair_sixteenths(sums, packed, 7, x2, x3, one, sixteen)
    sums = _nibble_pair_sixteenths(sums, packed, -1, x4, x5, one, sixteen)
    sums = _nibble_pair_sixteenths(sums, packed, -9, x6, x7, one, sixteen)
    return sums * (scales.to(tl.float32) * 16.0)


@triton.jit
def _clamped_rows(cols, n):
    """The rows [BLOCK_N, 1] int64 a program reads for its columns cols [BLOCK_N]: past n, the last
    real row (read, never stored), so the weight loads need no row mask."""
    return tl.minimum(cols, n - 1)[:, None].to(tl.int64)


@triton.jit
def _int4_words_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    packed_ptr,  # [E, 2 * inter, ceil(hidden / 8)] int32: gate rows then up rows
    scale_ptr,  # [E, 2 * inter, ceil(hidden / 32)] (the model dtype)
    ids_ptr,  # [num_pairs] expert of each (token, k) pair
    act_ptr,  # [num_pairs, inter] out, the scales' dtype
    counters_ptr,  # [num_counters] int32, zeroed here for the down kernel (when ZERO_COUNTERS)
    num_counters,
    hidden,
    inter,
    stride_x,
    stride_packed_expert,
    stride_scale_expert,
    stride_act,
    words_per_row,  # ceil(hidden / 8): passed, so Triton sees its divisibility (vector loads)
    groups_per_row,  # ceil(hidden / 32)
    TOP_K: tl.constexpr,
    ZERO_COUNTERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no mask in the loop
):
    pair = tl.program_id(0)
    if ZERO_COUNTERS:
        _zero_counters(counters_ptr, num_counters)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _clamped_rows(cols, inter)  # [BLOCK_N, 1]
    gate_packed = packed_ptr + expert * stride_packed_expert + rows * words_per_row
    up_packed = packed_ptr + expert * stride_packed_expert + (rows + inter) * words_per_row  # up's row j: I + j
    gate_scales = scale_ptr + expert * stride_scale_expert + rows * groups_per_row
    up_scales = scale_ptr + expert * stride_scale_expert + (rows + inter) * groups_per_row
    x_row_ptr = x_ptr + token * stride_x
    rows_zero = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    dtype = act_ptr.dtype.element_ty  # x in the weights' dtype, as the bf16 kernels feed it
    gate = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)  # per row and word lane: summed once, after
    up = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        gate += _int4_word_tile(gate_packed, gate_scales, x_row_ptr, k0, hidden, words_per_row, groups_per_row,
                                rows_zero, BLOCK_K, dtype, EVEN_K)
        up += _int4_word_tile(up_packed, up_scales, x_row_ptr, k0, hidden, words_per_row, groups_per_row,
                              rows_zero, BLOCK_K, dtype, EVEN_K)
    _store_silu_product(tl.sum(gate, axis=1), tl.sum(up, axis=1), act_ptr, pair, stride_act, cols, cols < inter)


@triton.jit
def _int4_words_down_slot(
    act_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, pair, rows, inter, stride_act,
    stride_packed_expert, stride_scale_expert, words_per_row, groups_per_row,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """One slot's weighted output for the program's rows [BLOCK_N, 1] (clamped):
    round(W_down[e] . act[pair]) * weight, [BLOCK_N] float32."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows_packed = packed_ptr + expert * stride_packed_expert + rows * words_per_row
    rows_scale = scale_ptr + expert * stride_scale_expert + rows * groups_per_row
    x_row_ptr = act_ptr + pair * stride_act
    rows_zero = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    dtype = act_ptr.dtype.element_ty
    y = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)  # per row and word lane: summed once, after
    for k0 in range(0, inter, BLOCK_K):
        y += _int4_word_tile(rows_packed, rows_scale, x_row_ptr, k0, inter, words_per_row, groups_per_row,
                             rows_zero, BLOCK_K, dtype, EVEN_K)
    return tl.sum(y, axis=1).to(dtype).to(tl.float32) * tl.load(weights_ptr + pair)


@triton.jit
def _int4_words_down_combine_kernel(
    act_ptr,  # [num_pairs, inter]
    packed_ptr,  # [E, hidden, ceil(inter / 8)] int32
    scale_ptr,  # [E, hidden, ceil(inter / 32)]
    ids_ptr,  # [num_pairs]
    weights_ptr,  # [num_pairs] float32 routing weights
    shared_ptr,  # [num_tokens, hidden] (read when HAS_SHARED)
    scratch_ptr,  # [num_pairs, hidden] float32 weighted slot outputs (GROUPS > 1)
    counters_ptr,  # [num_tokens, cdiv(hidden, BLOCK_N)] int32, zero on entry (GROUPS > 1)
    out_ptr,  # [num_tokens, hidden] out
    hidden,
    inter,
    stride_act,
    stride_packed_expert,
    stride_scale_expert,
    stride_shared,
    stride_out,
    words_per_row,  # ceil(inter / 8)
    groups_per_row,  # ceil(inter / 32)
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # slots per program
    GROUPS: tl.constexpr,  # programs per (token, column block): cdiv(TOP_K, SLOTS)
    HAS_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0: no mask in the loop
):
    token, col_block, group, cols, col_valid = _down_program(hidden, BLOCK_N)
    rows = _clamped_rows(cols, hidden)  # [BLOCK_N, 1]
    if GROUPS == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # slot order, as the twin sums
            acc += _int4_words_down_slot(act_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, token * TOP_K + k,
                                         rows, inter, stride_act, stride_packed_expert, stride_scale_expert,
                                         words_per_row, groups_per_row, BLOCK_N, BLOCK_K, EVEN_K)
        _store_token(acc, shared_ptr, out_ptr, token, cols, col_valid, stride_shared, stride_out, HAS_SHARED)
    else:
        for j in tl.static_range(SLOTS):
            slot = group * SLOTS + j
            if slot < TOP_K:
                pair = token * TOP_K + slot
                value = _int4_words_down_slot(act_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, pair, rows,
                                              inter, stride_act, stride_packed_expert, stride_scale_expert,
                                              words_per_row, groups_per_row, BLOCK_N, BLOCK_K, EVEN_K)
                tl.store(scratch_ptr + pair * hidden + cols, value, mask=col_valid)
        _combine_split_slots(scratch_ptr, counters_ptr, shared_ptr, out_ptr, token, col_block, cols, col_valid, hidden,
                             stride_shared, stride_out, TOP_K, GROUPS, HAS_SHARED, BLOCK_N)
