"""Fused MoE over int4 experts for a few tokens on tensor cores (decode, verify): Kimi-K2.5's routed
experts in the compressed-tensors pack-quantized layout (int4_reference.py), decoded in registers.

Why not the GEMV (triton_int4_gemv.py): a GEMV program reads one (token, expert) pair's x and a few
weight rows, so x is gathered again by every program and each weight is met by one FMA per token;
at Kimi-K2.5's shapes it held at about 20% of the H200's bandwidth whatever its tiles. Here a
program owns one expert's tile of BLOCK_N weight rows and all the routed rows of that expert (up
to BLOCK_M = 16 at once, the MMA's smallest N: the token rows are padded, not the weights), so the
tokens share each decoded weight and the products run on the tensor cores:

  acc [BLOCK_N, BLOCK_M] += W_tile [BLOCK_N, BLOCK_K] . x_tile^T [BLOCK_K, BLOCK_M]   (tl.dot)

The packed tile [BLOCK_N, BLOCK_K / 8] int32 is decoded to q * scale in the scales' dtype (the very
weights the twin's dequantized checkpoint holds: q is exact and the product is rounded once). On
CUDA with fp16 / bf16 scales inline PTX does it two weights an instruction (_word_weights_ptx:
nibbles i and i + 4 of a word land in one register's halves), elsewhere plain Triton nibble by
nibble (_nibble_weights: the interpreter, float32 scales); both give the same bits. The sum over K
does not care in which order the columns come, so word j's eight columns are laid out as the
decoding makes them (nibbles 0, 4, 1, 5, 2, 6, 3, 7: _tile_columns) and x's columns are loaded in
that order, instead of shuffling the weights into 8 j + i.

Read from sm_90 builds (fixtures/kernel_compile_low_precision.py's cases; SASS per K tile of the
inner loop, 4 warps): a nibble plane per dot (8 dots of K = 16 words, x gathered with stride 8)
2453 instructions per 128 x 256 gate_up tile (9.6 per weight: every plane stored to shared memory
one 16-bit value at a time for the wgmma); one interleaved tile per dot 1686 (6.6); the inline-PTX
decoding 1315 (5.1); 128 x 128 tiles 1188 (4.6; the down kernel 644 for 128 x 128, 5.0 per
weight). At the H200's 4.8 TB/s over 132 SMs an SM must take about 36 weights a cycle, 3.5 issued
instructions a weight: the launch rule takes the 128 x 128 tiles. Measured on the H200 by
scripts/check_low_precision_gpu.py (int4_moe_bandwidth) and sweep_low_precision_gpu.py.

Grids (programs, cdiv(N, BLOCK_N), SPLIT_K), one program slot per (token, expert) pair: the first
pair of each expert owns it (found on the device from the ids: no host sync, capturable in a CUDA
graph) and the others' programs return at once. Its rows are the pairs routed to that expert in
pair order, BLOCK_M at a time. Split-K spreads K over SPLIT_K programs so that the few experts of
a decode step still fill the GPU's SMs (int4_mma_launch_config's rule); their float32 partial sums
go to scratch, and the last program to arrive (a counter per row and tile) adds them in split order:
  - gate_up: the gate and up rows of the same BLOCK_N columns in one program; the last to arrive
    stores act = silu(gate) * up rounded as the twin rounds (gemv_common._store_silu_product's
    steps). With SPLIT_K 1 there is no scratch and no counter.
  - down: each program stores its rows' partial outputs [SPLIT_K, num_pairs, H]; a token's
    counter per column tile counts TOP_K * SPLIT_K arrivals, and the last sums each slot's splits,
    rounds it to the model dtype, weighs it and adds the slots in slot order (+ shared): the same
    sum whoever arrives last, so the result does not change from run to run.
The gate_up kernel's first program zeroes the down kernel's counters (it runs first on the
stream); gate_up's own counters (SPLIT_K > 1) come zeroed from the host.

Twin: int4_experts_forward_torch (int4_reference.py) plus the shared output. This module imports
triton: CUDA, or the interpreter tests (tests/ops/test_moe_int4_mma.py: fp16 / float32 only, the
interpreter's tl.dot is wrong on bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.moe.gemv_common import _zero_counters, no_pairs_output
from foretell.ops.moe.int4_reference import PACK, check_int4_expert_inputs

MMA_ROWS = 16  # tl.dot's smallest dimension: the routed token rows are padded to it
H200_SMS = 132  # SMs assumed where no CUDA device says (the interpreter tests)
MMA_KERNEL_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")


@triton.jit
def _expert_rows(ids_ptr, num_pairs, pair, m0, PAIRS_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """For the program of `pair`: whether it owns its expert (the expert's first pair), how many
    pairs go to that expert, and the pairs of its ranks m0 .. m0 + BLOCK_M (in pair order) with
    their mask [BLOCK_M]."""
    lanes = tl.arange(0, PAIRS_P)
    ids = tl.load(ids_ptr + lanes, mask=lanes < num_pairs, other=-1)  # [PAIRS_P]
    expert = tl.load(ids_ptr + pair)
    match = ids == expert
    owner = tl.min(tl.where(match, lanes, PAIRS_P), axis=0) == pair
    rank = tl.cumsum(match.to(tl.int32), axis=0) - 1  # [PAIRS_P]
    count = tl.sum(match.to(tl.int32), axis=0)
    ranks = m0 + tl.arange(0, BLOCK_M)
    chosen = match[None, :] & (rank[None, :] == ranks[:, None])  # [BLOCK_M, PAIRS_P]
    rows = tl.sum(tl.where(chosen, lanes[None, :], 0), axis=1)  # [BLOCK_M] pair of each rank
    return owner, count, expert.to(tl.int64), rows, ranks < count


@triton.jit
def _nibble_weights(packed, scales, i: tl.constexpr):
    """Plane i of the packed words [BLOCK_N, WORDS] (nibble i of each, q + 8 in [0, 16)) as weights
    q * scale in the scales' dtype, rounded once as the twin dequantizes. The nibble is made a float
    by its bits (no integer-to-float conversion): in 16 bits 1024 + q + 8 (fp16, 0x6400) or
    128 + q + 8 (bf16, 0x4300), in 32 bits 2^23 + q + 8; q comes out exact by one subtraction."""
    nibble = (packed >> (4 * i)) & 0xF
    dtype = scales.dtype
    if dtype == tl.float16:
        q = (nibble | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    elif dtype == tl.bfloat16:
        q = (nibble | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
    else:
        q = (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return q.to(dtype) * scales


@triton.jit
def _word_weights_ptx(packed, scales):
    """The eight planes of _nibble_weights at once, in inline PTX (CUDA, fp16 / bf16 scales): per
    word, nibbles i and i + 4 are masked into the two halves of one register over the magic
    number's bits (1024 + n in fp16, 128 + n in bf16: one lop3), then one fma.f16x2 / fma.bf16x2
    takes the magic and the 8 off exactly and another scales both, rounded once: about 16
    instructions a word, 2 a weight."""
    if scales.dtype == tl.float16:
        magic: tl.constexpr = "0x64006400"
        constants: tl.constexpr = "mov.b32 one, 0x3c003c00; mov.b32 m, 0xe408e408; mov.b32 z, 0x80008000; "
        fma: tl.constexpr = "fma.rn.f16x2 "
    else:
        magic: tl.constexpr = "0x43004300"
        constants: tl.constexpr = "mov.b32 one, 0x3f803f80; mov.b32 m, 0xc308c308; mov.b32 z, 0x80008000; "
        fma: tl.constexpr = "fma.rn.bf16x2 "
    # t = n * 1 - (magic + 8): exact; w = t * s + (-0): t * s rounded once (sm_80's bf16x2 has fma only)
    asm: tl.constexpr = (
        "{ .reg .b32 s, one, m, z, t0, t1, t2, t3, w; mov.b32 s, {$9, $9}; " + constants +
        "lop3.b32 t0, $8, 0x000f000f, " + magic + ", 0xea; shr.u32 w, $8, 4; "
        "lop3.b32 t1, w, 0x000f000f, " + magic + ", 0xea; shr.u32 w, $8, 8; "
        "lop3.b32 t2, w, 0x000f000f, " + magic + ", 0xea; shr.u32 w, $8, 12; "
        "lop3.b32 t3, w, 0x000f000f, " + magic + ", 0xea; " +
        fma + "t0, t0, one, m; " + fma + "t1, t1, one, m; " + fma + "t2, t2, one, m; " + fma + "t3, t3, one, m; " +
        fma + "t0, t0, s, z; " + fma + "t1, t1, s, z; " + fma + "t2, t2, s, z; " + fma + "t3, t3, s, z; "
        "mov.b32 {$0, $4}, t0; mov.b32 {$1, $5}, t1; mov.b32 {$2, $6}, t2; mov.b32 {$3, $7}, t3; }")
    dtype = scales.dtype
    return tl.inline_asm_elementwise(asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [packed, scales],
                                     dtype=(dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype),
                                     is_pure=True, pack=1)


@triton.jit
def _tile_columns(w0, BLOCK_K: tl.constexpr):
    """The columns of x [BLOCK_K] that meet the decoded tile's columns: word j's eight come as
    nibbles 0, 4, 1, 5, 2, 6, 3, 7 (the pairs the decoding makes in one register), and the sum over
    K does not care in which order."""
    c = tl.arange(0, BLOCK_K)
    return w0 * 8 + (c & ~7) + ((c & 1) << 2) + ((c >> 1) & 3)


@triton.jit
def _int4_tile_dot(acc, packed_rows, scale_rows, row_valid, w0, num_words, num_groups, x,
                   BLOCK_K: tl.constexpr, DECODE_PTX: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + W . x for the tile of words w0 .. w0 + BLOCK_K / 8: W [BLOCK_N, BLOCK_K]
    decoded from packed_rows / scale_rows [BLOCK_N, 1] (the rows' words and scales), x [BLOCK_K,
    BLOCK_M] x's columns _tile_columns(w0) in the scales' dtype."""
    word = w0 + tl.arange(0, BLOCK_K // 8)  # [WORDS] (int4_reference's PACK: 8 nibbles a word)
    w_ok = row_valid[:, None] & (word < num_words)[None, :]
    packed = tl.load(packed_rows + word[None, :], mask=w_ok, other=0, eviction_policy="evict_first")  # [BLOCK_N, WORDS]
    group = word // 4  # INT4_GROUP 32: 4 words a scale
    scales = tl.load(scale_rows + group[None, :], mask=row_valid[:, None] & (group < num_groups)[None, :],
                     other=0.0)  # [BLOCK_N, WORDS] the scales' dtype
    if DECODE_PTX:
        p0, p1, p2, p3, p4, p5, p6, p7 = _word_weights_ptx(packed, scales)
    else:
        p0 = _nibble_weights(packed, scales, 0)
        p1 = _nibble_weights(packed, scales, 1)
        p2 = _nibble_weights(packed, scales, 2)
        p3 = _nibble_weights(packed, scales, 3)
        p4 = _nibble_weights(packed, scales, 4)
        p5 = _nibble_weights(packed, scales, 5)
        p6 = _nibble_weights(packed, scales, 6)
        p7 = _nibble_weights(packed, scales, 7)
    # word j's columns 8 j .. 8 j + 7 hold nibbles 0, 4, 1, 5, 2, 6, 3, 7 (_tile_columns)
    w = tl.interleave(tl.interleave(tl.interleave(p0, p2), tl.interleave(p1, p3)),
                      tl.interleave(tl.interleave(p4, p6), tl.interleave(p5, p7)))  # [BLOCK_N, BLOCK_K]
    return tl.dot(w, x, acc, input_precision=DOT_PRECISION)


@triton.jit
def _x_tile(x_cols, x_valid, w0, k_end, dtype, BLOCK_K: tl.constexpr):
    """x^T's tile [BLOCK_K, BLOCK_M] for words w0 ..: x_cols [1, BLOCK_M] pointers to column 0 of
    each row, x_valid [1, BLOCK_M]; columns in _tile_columns' order, 0 past k_end."""
    cols = _tile_columns(w0, BLOCK_K)
    return tl.load(x_cols + cols[:, None], mask=(cols < k_end)[:, None] & x_valid, other=0.0).to(dtype)


@triton.jit
def _int4_mma_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    packed_ptr,  # [E, 2 * inter, ceil(hidden / 8)] int32: gate rows then up rows
    scale_ptr,  # [E, 2 * inter, ceil(hidden / 32)] (the model dtype)
    ids_ptr,  # [num_pairs] expert of each (token, k) pair
    act_ptr,  # [num_pairs, inter] out, the scales' dtype
    partial_ptr,  # [SPLIT_K, num_pairs, 2 * inter] float32 (SPLIT_K > 1)
    counters_ptr,  # [num_pairs * cdiv(inter, BLOCK_N)] int32, zero on entry (SPLIT_K > 1)
    down_counters_ptr,  # [num_down_counters] int32: zeroed here for the down kernel
    num_down_counters,
    num_pairs,
    hidden,
    inter,
    stride_x,
    stride_packed_expert,
    stride_scale_expert,
    stride_act,
    words_per_row,  # ceil(hidden / 8)
    groups_per_row,  # ceil(hidden / 32)
    words_per_split,  # a multiple of BLOCK_K / 8: columns 8 * words_per_split a split
    TOP_K: tl.constexpr,
    PAIRS_P: tl.constexpr,  # a power of two >= num_pairs
    SPLIT_K: tl.constexpr,
    DECODE_PTX: tl.constexpr,  # the words decoded by inline PTX (CUDA, 16-bit scales), else plain Triton
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    _zero_counters(down_counters_ptr, num_down_counters)  # program (0, 0, *) only
    first = _expert_rows(ids_ptr, num_pairs, pair, 0, PAIRS_P, BLOCK_M)
    owner, count, expert = first[0], first[1], first[2]
    if owner:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = cols < inter
        gate_rows = cols[:, None].to(tl.int64)
        up_rows = gate_rows + inter  # row I + j of [gate; up] is up's row j
        gate_packed = packed_ptr + expert * stride_packed_expert + gate_rows * words_per_row
        up_packed = packed_ptr + expert * stride_packed_expert + up_rows * words_per_row
        gate_scales = scale_ptr + expert * stride_scale_expert + gate_rows * groups_per_row
        up_scales = scale_ptr + expert * stride_scale_expert + up_rows * groups_per_row
        w_start = split * words_per_split  # (in words, so that Triton sees the loads' alignment)
        w_end = tl.minimum(w_start + words_per_split, words_per_row)
        k_end = tl.minimum(w_end * 8, hidden)
        dtype = act_ptr.dtype.element_ty
        for m0 in range(0, count, BLOCK_M):
            chunk = _expert_rows(ids_ptr, num_pairs, pair, m0, PAIRS_P, BLOCK_M)
            rows, row_valid = chunk[3], chunk[4]  # [BLOCK_M] the pairs of ranks m0 .. m0 + BLOCK_M
            x_cols = (x_ptr + (rows // TOP_K).to(tl.int64) * stride_x)[None, :]  # [1, BLOCK_M]
            gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for w0 in range(w_start, w_end, BLOCK_K // 8):
                x = _x_tile(x_cols, row_valid[None, :], w0, k_end, dtype, BLOCK_K)  # [BLOCK_K, BLOCK_M]
                gate = _int4_tile_dot(gate, gate_packed, gate_scales, col_valid, w0, words_per_row, groups_per_row,
                                      x, BLOCK_K, DECODE_PTX, DOT_PRECISION)
                up = _int4_tile_dot(up, up_packed, up_scales, col_valid, w0, words_per_row, groups_per_row, x,
                                    BLOCK_K, DECODE_PTX, DOT_PRECISION)
            store = row_valid[None, :] & col_valid[:, None]  # [BLOCK_N, BLOCK_M]
            if SPLIT_K > 1:
                # this split's sums, then the last of the SPLIT_K programs adds them all in split order
                part = partial_ptr + rows[None, :].to(tl.int64) * (2 * inter) + cols[:, None]  # [BLOCK_N, BLOCK_M]
                split_stride = num_pairs * 2 * inter
                tl.store(part + split * split_stride, gate, mask=store)
                tl.store(part + split * split_stride + inter, up, mask=store)
                tl.debug_barrier()
                arrived = tl.atomic_add(counters_ptr + rows * tl.num_programs(1) + tile, 1, mask=row_valid,
                                        sem="acq_rel", scope="gpu")  # [BLOCK_M]
                is_last = row_valid & (arrived == SPLIT_K - 1)
                if tl.sum(is_last.to(tl.int32), axis=0) > 0:  # (most programs are not the last of any row)
                    store = store & is_last[None, :]
                    gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                    up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                    for s in tl.static_range(SPLIT_K):
                        gate += tl.load(part + s * split_stride, mask=store, other=0.0, cache_modifier=".cg")
                        up += tl.load(part + s * split_stride + inter, mask=store, other=0.0, cache_modifier=".cg")
                    _store_act(gate, up, act_ptr, rows, cols, stride_act, store)
            else:
                _store_act(gate, up, act_ptr, rows, cols, stride_act, store)


@triton.jit
def _store_act(gate, up, act_ptr, rows, cols, stride_act, mask):
    """act[rows, cols] = silu(gate) * up from the float32 projections [BLOCK_N, BLOCK_M], rounded
    where the twin rounds: each projection, silu(gate), then the product (to act's dtype)."""
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(act_ptr + rows[None, :].to(tl.int64) * stride_act + cols[:, None], (silu * up).to(dtype), mask=mask)


@triton.jit
def _int4_mma_down_kernel(
    act_ptr,  # [num_pairs, inter]
    packed_ptr,  # [E, hidden, ceil(inter / 8)] int32
    scale_ptr,  # [E, hidden, ceil(inter / 32)]
    ids_ptr,  # [num_pairs]
    weights_ptr,  # [num_pairs] float32 routing weights
    shared_ptr,  # [num_tokens, hidden] (read when HAS_SHARED)
    partial_ptr,  # [SPLIT_K, num_pairs, hidden] float32 unweighted partial outputs
    counters_ptr,  # [num_tokens * cdiv(hidden, BLOCK_N)] int32, zero on entry
    out_ptr,  # [num_tokens, hidden] out
    num_pairs,
    hidden,
    inter,
    stride_act,
    stride_packed_expert,
    stride_scale_expert,
    stride_shared,
    stride_out,
    words_per_row,  # ceil(inter / 8)
    groups_per_row,  # ceil(inter / 32)
    words_per_split,  # a multiple of BLOCK_K / 8: columns 8 * words_per_split a split
    TOP_K: tl.constexpr,
    PAIRS_P: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    DECODE_PTX: tl.constexpr,  # the words decoded by inline PTX (CUDA, 16-bit scales), else plain Triton
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    first = _expert_rows(ids_ptr, num_pairs, pair, 0, PAIRS_P, BLOCK_M)
    owner, count, expert = first[0], first[1], first[2]
    if owner:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = cols < hidden
        w_packed = packed_ptr + expert * stride_packed_expert + cols[:, None].to(tl.int64) * words_per_row
        w_scales = scale_ptr + expert * stride_scale_expert + cols[:, None].to(tl.int64) * groups_per_row
        w_start = split * words_per_split  # (in words, so that Triton sees the loads' alignment)
        w_end = tl.minimum(w_start + words_per_split, words_per_row)
        k_end = tl.minimum(w_end * 8, inter)
        dtype = act_ptr.dtype.element_ty
        split_stride = num_pairs * hidden
        for m0 in range(0, count, BLOCK_M):
            chunk = _expert_rows(ids_ptr, num_pairs, pair, m0, PAIRS_P, BLOCK_M)
            rows, row_valid = chunk[3], chunk[4]  # [BLOCK_M] the pairs of ranks m0 .. m0 + BLOCK_M
            act_cols = (act_ptr + rows.to(tl.int64) * stride_act)[None, :]  # [1, BLOCK_M]
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for w0 in range(w_start, w_end, BLOCK_K // 8):
                x = _x_tile(act_cols, row_valid[None, :], w0, k_end, dtype, BLOCK_K)  # [BLOCK_K, BLOCK_M]
                acc = _int4_tile_dot(acc, w_packed, w_scales, col_valid, w0, words_per_row, groups_per_row, x,
                                     BLOCK_K, DECODE_PTX, DOT_PRECISION)
            mine = row_valid[None, :] & col_valid[:, None]  # [BLOCK_N, BLOCK_M]
            tl.store(partial_ptr + split * split_stride + rows[None, :].to(tl.int64) * hidden + cols[:, None], acc,
                     mask=mine)
            # every thread's stores before the counts; the last of a token's TOP_K * SPLIT_K arrivals sums
            tl.debug_barrier()
            tokens = rows // TOP_K
            arrived = tl.atomic_add(counters_ptr + tokens * tl.num_programs(1) + tile, 1, mask=row_valid,
                                    sem="acq_rel", scope="gpu")  # [BLOCK_M]
            is_last = row_valid & (arrived == TOP_K * SPLIT_K - 1)
            if tl.sum(is_last.to(tl.int32), axis=0) > 0:  # (most programs are not the last of any token)
                _combine_slots(partial_ptr, weights_ptr, shared_ptr, out_ptr, tokens, cols, mine & is_last[None, :],
                               row_valid, hidden, split_stride, stride_shared, stride_out, dtype, TOP_K, SPLIT_K,
                               HAS_SHARED, BLOCK_N, BLOCK_M)


@triton.jit
def _combine_slots(partial_ptr, weights_ptr, shared_ptr, out_ptr, tokens, cols, last, row_valid, hidden, split_stride,
                   stride_shared, stride_out, dtype, TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[tokens, cols] where `last` [BLOCK_N, BLOCK_M]: each of the token's slots summed over its
    splits (split order), rounded to the model dtype and weighed, the slots added in slot order as
    the twin sums (+ shared), cast to out's dtype once."""
    total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = tokens * TOP_K + k  # [BLOCK_M]
        slot_part = partial_ptr + slot[None, :].to(tl.int64) * hidden + cols[:, None]
        y = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            y += tl.load(slot_part + s * split_stride, mask=last, other=0.0, cache_modifier=".cg")
        weight = tl.load(weights_ptr + slot, mask=row_valid, other=0.0)  # [BLOCK_M]
        total += y.to(dtype).to(tl.float32) * weight[None, :]
    token_cols = tokens[None, :].to(tl.int64)
    if HAS_SHARED:
        total += tl.load(shared_ptr + token_cols * stride_shared + cols[:, None], mask=last, other=0.0).to(tl.float32)
    tl.store(out_ptr + token_cols * stride_out + cols[:, None], total.to(out_ptr.dtype.element_ty), mask=last)


def int4_mma_launch_config(num_tokens: int, top_k: int, hidden: int, inter: int, num_sms: int = H200_SMS) -> dict:
    """Tiles and split-K of the two kernels. Split-K is the rule that fills the GPU: the distinct
    experts of a step are at most its pairs (8 at one token, Kimi-K2.5), and a kernel of
    pairs x column tiles programs is split along K until there are about four programs per SM,
    no split shorter than two K tiles."""
    num_pairs = max(num_tokens * top_k, 1)

    def kernel(n: int, k: int, block_n: int, block_k: int) -> dict:
        programs = num_pairs * triton.cdiv(n, block_n)
        split = max(1, min(triton.cdiv(4 * num_sms, programs), k // (2 * block_k)))
        return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}

    return {"gate_up": kernel(inter, hidden, 128, 128), "down": kernel(hidden, inter, 128, 128)}


def _resolve(config: dict | None, num_tokens: int, top_k: int, hidden: int, inter: int, num_sms: int) -> dict:
    resolved = int4_mma_launch_config(num_tokens, top_k, hidden, inter, num_sms)
    for name, overrides in (config or {}).items():
        if name not in resolved or not isinstance(overrides, dict):
            raise ValueError(f"int4 MoE MMA config keys are 'gate_up' and 'down' (dicts), got {name!r}")
        unknown = sorted(set(overrides) - set(MMA_KERNEL_KEYS))
        if unknown:
            raise ValueError(f"unknown int4 MoE MMA {name} config keys {unknown}; expected {list(MMA_KERNEL_KEYS)}")
        resolved[name].update(overrides)
    for name, cfg in resolved.items():
        block_n, block_k, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
        if block_k < 16 * PACK or block_k & (block_k - 1) or block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"int4 MoE MMA {name}: BLOCK_K must be a power of two >= {16 * PACK} (16 words a "
                             f"nibble-plane dot) and BLOCK_N a power of two >= 16, got {cfg}")
        if not isinstance(split, int) or split < 1:
            raise ValueError(f"int4 MoE MMA {name}: SPLIT_K must be an integer >= 1, got {split!r}")
    return resolved


@dataclass(frozen=True)
class _Splits:
    """How one kernel's K is cut: each of `splits` programs takes k_per_split columns (a multiple of
    BLOCK_K; the last may take fewer), none empty."""

    splits: int
    k_per_split: int

    @staticmethod
    def of(k: int, cfg: dict) -> "_Splits":
        block_k = cfg["BLOCK_K"]
        tiles = triton.cdiv(k, block_k)
        per = triton.cdiv(tiles, min(cfg["SPLIT_K"], tiles))
        return _Splits(triton.cdiv(tiles, per), per * block_k)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS


def fused_int4_experts_mma_triton(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up_packed: torch.Tensor,  # [E, 2 * I, ceil(H / 8)] int32
    gate_up_scale: torch.Tensor,  # [E, 2 * I, ceil(H / 32)]
    down_packed: torch.Tensor,  # [E, H, ceil(I / 8)] int32
    down_scale: torch.Tensor,  # [E, H, ceil(I / 32)]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int
    shared: torch.Tensor | None = None,  # [num_tokens, H]: added (the shared experts' output)
    out_dtype: torch.dtype = torch.float32,
    config: dict | None = None,  # {"gate_up": {...}, "down": {...}} overrides of int4_mma_launch_config
    decode_ptx: bool | None = None,  # words decoded by inline PTX; None: where it can (CUDA, 16-bit scales)
) -> torch.Tensor:  # [num_tokens, H] out_dtype: the top_k experts' sum (+ shared)
    """int4_experts_forward_torch (+ shared) in two launches on tensor cores, each used expert's
    packed words read once per column tile. Both decodings give the same weights, bit for bit."""
    num_tokens, top_k, hidden_size, inter = check_int4_expert_inputs(
        hidden, gate_up_packed, gate_up_scale, down_packed, down_scale, weights, ids, shared)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return no_pairs_output(num_tokens, hidden_size, shared, out_dtype, hidden.device)
    device, dtype = hidden.device, gate_up_scale.dtype
    cfg = _resolve(config, num_tokens, top_k, hidden_size, inter, _num_sms(device))
    up_cfg, down_cfg = cfg["gate_up"], cfg["down"]
    up_split, down_split = _Splits.of(hidden_size, up_cfg), _Splits.of(inter, down_cfg)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    gate_up_packed, gate_up_scale, down_packed, down_scale = (
        t.contiguous() for t in (gate_up_packed, gate_up_scale, down_packed, down_scale))
    flat_ids = ids.reshape(num_pairs).contiguous()  # [num_pairs]
    pair_weights = weights.reshape(num_pairs).float().contiguous()  # [num_pairs]
    up_tiles, down_tiles = triton.cdiv(inter, up_cfg["BLOCK_N"]), triton.cdiv(hidden_size, down_cfg["BLOCK_N"])
    act = torch.empty(num_pairs, inter, dtype=dtype, device=device)  # [num_pairs, I]
    out = torch.empty(num_tokens, hidden_size, dtype=out_dtype, device=device)  # [T, H]
    down_partial = torch.empty(down_split.splits, num_pairs, hidden_size, dtype=torch.float32, device=device)
    down_counters = torch.empty(num_tokens * down_tiles, dtype=torch.int32, device=device)
    if up_split.splits > 1:
        up_partial = torch.empty(up_split.splits, num_pairs, 2 * inter, dtype=torch.float32, device=device)
        up_counters = torch.zeros(num_pairs * up_tiles, dtype=torch.int32, device=device)
    else:
        up_partial, up_counters = act, down_counters  # not read
    pairs_p = max(MMA_ROWS, triton.next_power_of_2(num_pairs))  # (one build for 1 to 16 pairs)
    precision = "ieee" if dtype == torch.float32 else "tf32"  # (tf32 is ignored for 16-bit inputs)
    ptx_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if decode_ptx and not ptx_ok:
        raise ValueError(f"decode_ptx=True needs CUDA tensors with float16 / bfloat16 scales, got {dtype} on "
                         f"{device}")
    decode_ptx = ptx_ok if decode_ptx is None else decode_ptx

    def options(kernel_cfg: dict) -> dict:
        return {key: kernel_cfg[key] for key in MMA_KERNEL_KEYS if key != "SPLIT_K"}

    _int4_mma_gate_up_kernel[(num_pairs, up_tiles, up_split.splits)](
        hidden, gate_up_packed, gate_up_scale, flat_ids, act, up_partial, up_counters, down_counters,
        down_counters.numel(), num_pairs, hidden_size, inter, hidden.stride(0), gate_up_packed.stride(0),
        gate_up_scale.stride(0), act.stride(0), gate_up_packed.shape[2], gate_up_scale.shape[2],
        up_split.k_per_split // 8, TOP_K=top_k, PAIRS_P=pairs_p, SPLIT_K=up_split.splits, DECODE_PTX=decode_ptx,
        DOT_PRECISION=precision, BLOCK_M=MMA_ROWS, **options(up_cfg),
    )
    _int4_mma_down_kernel[(num_pairs, down_tiles, down_split.splits)](
        act, down_packed, down_scale, flat_ids, pair_weights, shared if shared is not None else out, down_partial,
        down_counters, out, num_pairs, hidden_size, inter, act.stride(0), down_packed.stride(0),
        down_scale.stride(0), shared.stride(0) if shared is not None else 0, out.stride(0), down_packed.shape[2],
        down_scale.shape[2], down_split.k_per_split // 8, TOP_K=top_k, PAIRS_P=pairs_p, SPLIT_K=down_split.splits,
        HAS_SHARED=shared is not None, DECODE_PTX=decode_ptx, DOT_PRECISION=precision, BLOCK_M=MMA_ROWS,
        **options(down_cfg),
    )
    return out
