"""Fused MoE over int4 experts for a few tokens (decode, verify): Kimi-K2.5's routed experts in the
compressed-tensors pack-quantized layout (int4_reference.py), unpacked and scaled in-kernel.

The same two GEMV kernels as the bf16 path (triton_gemv.py; read its docstring for the shapes, the
slot split of the down kernel and its counters), with the weight tiles read as packed words (all
that does not read weights is gemv_common.py's):
  - a [BLOCK_N, BLOCK_K] weight tile is [BLOCK_N, BLOCK_K / 8] int32 words and [BLOCK_N,
    BLOCK_K / 32] scales, 4.25 bits a weight instead of 16: at one token the step is bound by
    these bytes;
  - each word's 8 nibbles (column 8 j + i is nibble i of word j) are made floats by their bits, a
    byte at a time: one shift puts the byte's high nibble in the float mantissa's top 4 bits and
    its low nibble in the next 4, and one logic op each masks a nibble into 1.0's bits, giving
    1 + q / 16 and 1 + q / 256 exactly (_nibble_pair: no integer-to-float conversion, a
    quarter-rate instruction, and no subtraction: the 1s and the 8s come off once per word lane
    through x's correction c, which _x_lanes computes once a tile for all of a program's rows
    with x's lanes pre-scaled by 256 and 16, exact powers of two). Against the previous
    2^23 + q - (2^23 + 8) form this is 360 instead of 421 sm_90 instructions per 1024-column
    tile of four gate and four up rows; the float32 sums lose at most ~7 of their 24 bits to
    the correction's cancellation, far below the bf16 roundings the twin makes. Nibble i of
    every word is taken at once against x's columns 8 j + i, so nothing is reshaped and the
    words stay in the layout they were loaded in (the first version's reshapes compiled to
    shared-memory round trips and barriers in every tile for sm_90, and read a small share of the
    H200's bandwidth at Kimi-K2.5's shapes: docs/perf-log.md); each word's 8 products are
    summed, times the word's group scale (the kernels are written for int4_reference's PACK 8 and
    INT4_GROUP 32), accumulated per row and word lane, and summed across lanes once at the end.
    So the weights enter as q * s exactly, not rounded to the scales' dtype as the twin's
    dequantized checkpoint (a relative difference of 2^-9 per weight in bf16, averaging out
    in the sums); the bf16 kernels' other roundings stay (projection, silu, product; each
    expert's output before its routing weight).

Twin: int4_experts_forward_torch (int4_reference.py: the used experts dequantized, then
experts_forward_torch) plus the shared output. Grids are fixed by shapes and the launch config and
nothing is read on the host, so the forward can be captured in a CUDA graph. Tiles: the H200's
best at Kimi-K2.5's shapes (H = 7168, I = 2048, 8 of 384 experts; int4_launch_config). By default
(LANES) the weight loops are triton_int4_lanes.py's, over x's lanes made once per token by one
small launch before each kernel; the loops below (_x_lanes, _int4_words) are LANES off.
This module imports triton: CUDA (or the interpreter tests, tests/ops/test_moe_int4.py) only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.moe.int4_reference import INT4_GROUP, check_int4_expert_inputs
from foretell.ops.moe.triton_int4_lanes import FLOAT_ONE_BITS, _lanes_gate_up_sums, _lanes_row_sums, x_lanes
from foretell.ops.moe.gemv_common import (
    _combine_split_slots,
    _down_program,
    _store_silu_product,
    _store_token,
    _zero_counters,
    launch_options,
    no_pairs_output,
    override_kernel_configs,
    plan_gemv,
)


@triton.jit
def _x_lanes(x_row_ptr, k0, K, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x's columns k0 .. k0 + BLOCK_K (read in dtype, 0 past K) as the 8 vectors [BLOCK_K / 8] that
    meet nibble i of each packed word (column 8 j + i), scaled by 2^8 (even i) or 2^4 (odd i) to
    meet _nibble_floats, and the words' correction c [BLOCK_K / 8] = sum_i (2^8 or 2^4 + 8) x_i:
    what the kernels compute once a tile for all the program's rows."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    x0 = tl.load(x_row_ptr + word * 8, mask=word * 8 < K, other=0.0).to(dtype).to(tl.float32)
    x1 = tl.load(x_row_ptr + word * 8 + 1, mask=word * 8 + 1 < K, other=0.0).to(dtype).to(tl.float32)
    x2 = tl.load(x_row_ptr + word * 8 + 2, mask=word * 8 + 2 < K, other=0.0).to(dtype).to(tl.float32)
    x3 = tl.load(x_row_ptr + word * 8 + 3, mask=word * 8 + 3 < K, other=0.0).to(dtype).to(tl.float32)
    x4 = tl.load(x_row_ptr + word * 8 + 4, mask=word * 8 + 4 < K, other=0.0).to(dtype).to(tl.float32)
    x5 = tl.load(x_row_ptr + word * 8 + 5, mask=word * 8 + 5 < K, other=0.0).to(dtype).to(tl.float32)
    x6 = tl.load(x_row_ptr + word * 8 + 6, mask=word * 8 + 6 < K, other=0.0).to(dtype).to(tl.float32)
    x7 = tl.load(x_row_ptr + word * 8 + 7, mask=word * 8 + 7 < K, other=0.0).to(dtype).to(tl.float32)
    c = 264.0 * ((x0 + x2) + (x4 + x6)) + 24.0 * ((x1 + x3) + (x5 + x7))  # [BLOCK_K / 8]
    return x0 * 256.0, x1 * 16.0, x2 * 256.0, x3 * 16.0, x4 * 256.0, x5 * 16.0, x6 * 256.0, x7 * 16.0, c


@triton.jit
def _nibble_pair(sums, packed, shift: tl.constexpr, x_even, x_odd):
    """sums + f_even x_even + f_odd x_odd for the byte of packed at bits 8 k .. 8 k + 7 (shift = 15 -
    8 k, negative: to the right): the byte moved so its high nibble q_odd fills the float mantissa's
    top 4 bits and its low nibble q_even the next 4, each masked into 1.0's bits: f_odd = 1 + q_odd
    / 16, f_even = 1 + q_even / 256, exactly, with one shift and one logic op a nibble (no integer
    to float conversion, no subtraction: the words' correction c takes the 1s and the 8s off)."""
    if shift >= 0:
        moved = packed << shift
    else:
        moved = packed >> (-shift)
    f_odd = ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
    f_even = ((moved & 0x00078000) | 0x3F800000).to(tl.float32, bitcast=True)
    return sums + f_even * x_even[None, :] + f_odd * x_odd[None, :]


@triton.jit
def _int4_words(packed_rows, scale_rows, k0, row_valid, num_words, num_groups, x0, x1, x2, x3, x4, x5, x6, x7, c,
                BLOCK_K: tl.constexpr):
    """Per row and packed word of the tile at columns k0 .. k0 + BLOCK_K: scale * sum over the word's
    8 nibbles of (q - 8) * x, [BLOCK_N, BLOCK_K / 8] float32, from _x_lanes' vectors. packed_rows /
    scale_rows [BLOCK_N, 1]: the rows' packed words and scales. With f_i = 1 + q_i 2^-e_i
    (_nibble_pair; e_i 8 or 4) and x'_i = 2^e_i x_i, sum_i f_i x'_i - c = sum_i (q_i - 8) x_i."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(packed_rows + word[None, :], mask=row_valid[:, None] & (word < num_words)[None, :], other=0,
                     eviction_policy="evict_first")  # [BLOCK_N, WORDS] int32
    sums = tl.zeros(packed.shape, tl.float32) - c[None, :]
    sums = _nibble_pair(sums, packed, 15, x0, x1)
    sums = _nibble_pair(sums, packed, 7, x2, x3)
    sums = _nibble_pair(sums, packed, -1, x4, x5)
    sums = _nibble_pair(sums, packed, -9, x6, x7)
    group = word // 4  # 32 columns a scale: 4 words
    scales = tl.load(scale_rows + group[None, :], mask=row_valid[:, None] & (group < num_groups)[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_N, WORDS]
    return sums * scales


@triton.jit
def _int4_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden] (read unless LANES)
    lanes_ptr,  # [num_tokens, 9, lanes_words] float32: x's lanes (triton_int4_lanes.py; read when LANES)
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
    lanes_words,  # the lanes buffer's words a lane (words_per_row padded to whole tiles)
    one,  # FLOAT_ONE_BITS (a runtime value: ptxas keeps it in a register, the masks are immediates)
    TOP_K: tl.constexpr,
    ZERO_COUNTERS: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    if ZERO_COUNTERS:
        _zero_counters(counters_ptr, num_counters)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < inter
    num_words, num_groups = words_per_row, groups_per_row
    if LANES:
        gate_sum, up_sum = _lanes_gate_up_sums(packed_ptr, scale_ptr, lanes_ptr, expert, token, cols, col_valid, inter,
                                               stride_packed_expert, stride_scale_expert, num_words, num_groups,
                                               lanes_words, one, BLOCK_N, BLOCK_K)
        _store_silu_product(gate_sum, up_sum, act_ptr, pair, stride_act, cols, col_valid)
        return
    up_rows = (cols + inter)[:, None].to(tl.int64)  # row I + j of [gate; up] is up's row j
    gate_packed = packed_ptr + expert * stride_packed_expert + cols[:, None].to(tl.int64) * num_words
    up_packed = packed_ptr + expert * stride_packed_expert + up_rows * num_words
    gate_scales = scale_ptr + expert * stride_scale_expert + cols[:, None].to(tl.int64) * num_groups
    up_scales = scale_ptr + expert * stride_scale_expert + up_rows * num_groups
    dtype = act_ptr.dtype.element_ty
    # x in the weights' dtype, as the bf16 kernels feed it (_x_lanes rounds it)
    gate = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)  # per row and word lane: summed once, after
    up = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        x0, x1, x2, x3, x4, x5, x6, x7, c = _x_lanes(x_ptr + token * stride_x, k0, hidden, BLOCK_K, dtype)
        gate += _int4_words(gate_packed, gate_scales, k0, col_valid, num_words, num_groups, x0, x1, x2, x3, x4, x5,
                            x6, x7, c, BLOCK_K)
        up += _int4_words(up_packed, up_scales, k0, col_valid, num_words, num_groups, x0, x1, x2, x3, x4, x5, x6, x7,
                          c, BLOCK_K)
    _store_silu_product(tl.sum(gate, axis=1), tl.sum(up, axis=1), act_ptr, pair, stride_act, cols, col_valid)


@triton.jit
def _int4_down_slot(
    act_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, pair, cols, col_valid, inter, stride_act,
    stride_packed_expert, stride_scale_expert, words_per_row, groups_per_row, lanes_ptr, lanes_words, one,
    LANES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One slot's weighted output for BLOCK_N columns: round(W_down[e] . act[pair]) * weight."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    num_words, num_groups = words_per_row, groups_per_row  # ceil(inter / 8), ceil(inter / 32)
    dtype = act_ptr.dtype.element_ty
    if LANES:
        y = _lanes_row_sums(packed_ptr, scale_ptr, lanes_ptr, expert, pair, cols, col_valid, stride_packed_expert,
                            stride_scale_expert, num_words, num_groups, lanes_words, one, BLOCK_N, BLOCK_K)
        return y.to(dtype).to(tl.float32) * tl.load(weights_ptr + pair)
    rows_packed = packed_ptr + expert * stride_packed_expert + cols[:, None].to(tl.int64) * num_words
    rows_scale = scale_ptr + expert * stride_scale_expert + cols[:, None].to(tl.int64) * num_groups
    y = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)  # per row and word lane: summed once, after
    for k0 in range(0, inter, BLOCK_K):
        x0, x1, x2, x3, x4, x5, x6, x7, c = _x_lanes(act_ptr + pair * stride_act, k0, inter, BLOCK_K, dtype)
        y += _int4_words(rows_packed, rows_scale, k0, col_valid, num_words, num_groups, x0, x1, x2, x3, x4, x5, x6,
                         x7, c, BLOCK_K)
    return tl.sum(y, axis=1).to(dtype).to(tl.float32) * tl.load(weights_ptr + pair)


@triton.jit
def _int4_down_combine_kernel(
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
    lanes_ptr,  # [num_pairs, 9, lanes_words] float32: act's lanes (read when LANES)
    lanes_words,  # the lanes buffer's words a lane (words_per_row padded to whole tiles)
    one,  # FLOAT_ONE_BITS
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # slots per program
    GROUPS: tl.constexpr,  # programs per (token, column block): cdiv(TOP_K, SLOTS)
    HAS_SHARED: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token, col_block, group, cols, col_valid = _down_program(hidden, BLOCK_N)
    if GROUPS == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # slot order, as the twin sums
            acc += _int4_down_slot(act_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, token * TOP_K + k, cols,
                                   col_valid, inter, stride_act, stride_packed_expert, stride_scale_expert,
                                   words_per_row, groups_per_row, lanes_ptr, lanes_words, one,
                                   LANES, BLOCK_N, BLOCK_K)
        _store_token(acc, shared_ptr, out_ptr, token, cols, col_valid, stride_shared, stride_out, HAS_SHARED)
    else:
        for j in tl.static_range(SLOTS):
            slot = group * SLOTS + j
            if slot < TOP_K:
                pair = token * TOP_K + slot
                value = _int4_down_slot(act_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, pair, cols, col_valid,
                                        inter, stride_act, stride_packed_expert, stride_scale_expert,
                                        words_per_row, groups_per_row, lanes_ptr, lanes_words, one,
                                        LANES, BLOCK_N, BLOCK_K)
                tl.store(scratch_ptr + pair * hidden + cols, value, mask=col_valid)
        _combine_split_slots(scratch_ptr, counters_ptr, shared_ptr, out_ptr, token, col_block, cols, col_valid, hidden,
                             stride_shared, stride_out, TOP_K, GROUPS, HAS_SHARED, BLOCK_N)


def int4_launch_config(num_tokens: int, top_k: int) -> dict:
    """The H200's best at Kimi-K2.5's shapes (H = 7168, I = 2048, 8 of 384 experts) in a CUDA graph
    over 16 MoE layers, used at every token count: both kernels over x's lanes
    (triton_int4_lanes.py), gate_up four rows of gate and of up a program over 512-column tiles on
    one warp, the down kernel four columns over 256 on one warp, slots spread over at most 8
    programs a column block. LANES False: the kernels that compute x's lanes in every tile, best
    at 8d8d90d's tiles (gate_up 8 x 512 on two warps, down 8 x 256 on one). The figures, both
    forms side by side: docs/perf-log.md, 2026-12-04."""
    return {
        "gate_up": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 1, "LANES": True},
        "down": {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 1, "SPLIT": min(max(top_k, 1), 8), "LANES": True},
    }


def candidate_configs(num_tokens: int, top_k: int) -> list[dict]:
    """Whole configs for the in-graph sweep (bench/kernels/moe_int4_chain.py): the per-tile lanes
    kernels at their best tiles, and the lanes kernels' tiles around the default."""
    default = int4_launch_config(num_tokens, top_k)
    configs = [{"gate_up": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2, "LANES": False},
                "down": {**default["down"], "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 1, "LANES": False}}]
    for rows, columns, warps in ((4, 512, 1), (4, 1024, 1), (2, 1024, 1), (8, 512, 1), (2, 512, 1), (4, 256, 1)):
        gate_up = {"BLOCK_N": rows, "BLOCK_K": columns, "num_warps": warps, "LANES": True}
        for down_rows, down_columns, down_warps in ((4, 256, 1), (4, 512, 1), (4, 512, 2)):
            configs.append({"gate_up": gate_up, "down": {**default["down"], "BLOCK_N": down_rows,
                                                         "BLOCK_K": down_columns, "num_warps": down_warps}})
    return [c for c in configs if c != default]


def _resolve(config: dict | None, num_tokens: int, top_k: int) -> dict:
    resolved = override_kernel_configs(int4_launch_config(num_tokens, top_k), config, "int4 MoE", ("LANES",))
    for name, cfg in resolved.items():
        block_k = cfg["BLOCK_K"]
        if block_k < INT4_GROUP or block_k & (block_k - 1) or cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1):
            raise ValueError(f"int4 MoE {name}: BLOCK_K must be a power of two >= {INT4_GROUP} and BLOCK_N a power "
                             f"of two, got {cfg}")
    return resolved


def _lanes_or_none(x: torch.Tensor, dtype: torch.dtype, cfg: dict) -> torch.Tensor | None:
    """x's lanes for a kernel whose config asks for them (LANES), padded to its tiles; else None."""
    return x_lanes(x, dtype, cfg["BLOCK_K"] // 8) if cfg["LANES"] else None


def fused_int4_experts_gemv_triton(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up_packed: torch.Tensor,  # [E, 2 * I, ceil(H / 8)] int32
    gate_up_scale: torch.Tensor,  # [E, 2 * I, ceil(H / 32)]
    down_packed: torch.Tensor,  # [E, H, ceil(I / 8)] int32
    down_scale: torch.Tensor,  # [E, H, ceil(I / 32)]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int
    shared: torch.Tensor | None = None,  # [num_tokens, H]: added (the shared experts' output)
    out_dtype: torch.dtype = torch.float32,
    config: dict | None = None,  # {"gate_up": {...}, "down": {...}} overrides of int4_launch_config
) -> torch.Tensor:  # [num_tokens, H] out_dtype: the top_k experts' sum (+ shared)
    """int4_experts_forward_torch (+ shared) in two launches, reading each expert's packed words once."""
    num_tokens, top_k, hidden_size, inter = check_int4_expert_inputs(
        hidden, gate_up_packed, gate_up_scale, down_packed, down_scale, weights, ids, shared)
    if num_tokens * top_k == 0:
        return no_pairs_output(num_tokens, hidden_size, shared, out_dtype, hidden.device)
    cfg = _resolve(config, num_tokens, top_k)
    up_cfg, down_cfg = cfg["gate_up"], cfg["down"]
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    gate_up_packed, gate_up_scale, down_packed, down_scale = (
        t.contiguous() for t in (gate_up_packed, gate_up_scale, down_packed, down_scale))
    plan = plan_gemv(hidden, weights, ids, shared, inter, gate_up_scale.dtype, out_dtype, down_cfg["SPLIT"],
                     down_cfg["BLOCK_N"])
    up_lanes = _lanes_or_none(hidden, gate_up_scale.dtype, up_cfg)
    _int4_gate_up_kernel[plan.gate_up_grid(up_cfg["BLOCK_N"])](
        hidden, hidden if up_lanes is None else up_lanes, gate_up_packed, gate_up_scale, plan.flat_ids, plan.act,
        plan.counters, plan.num_counters, hidden_size, inter, hidden.stride(0), gate_up_packed.stride(0),
        gate_up_scale.stride(0), plan.act.stride(0), gate_up_packed.shape[2], gate_up_scale.shape[2],
        0 if up_lanes is None else up_lanes.shape[2], FLOAT_ONE_BITS, **plan.gate_up_constexprs,
        **launch_options(up_cfg),
    )
    down_lanes = _lanes_or_none(plan.act, plan.act.dtype, down_cfg)
    _int4_down_combine_kernel[plan.down_grid](
        plan.act, down_packed, down_scale, plan.flat_ids, plan.pair_weights, plan.shared_or_out, plan.scratch,
        plan.counters, plan.out, hidden_size, inter, plan.act.stride(0), down_packed.stride(0), down_scale.stride(0),
        plan.stride_shared, plan.out.stride(0), down_packed.shape[2], down_scale.shape[2],
        plan.act if down_lanes is None else down_lanes, 0 if down_lanes is None else down_lanes.shape[2],
        FLOAT_ONE_BITS, **plan.down_constexprs, **launch_options(down_cfg),
        enable_fp_fusion=False,  # each weighted slot output rounded to float32 before it is added
    )
    return plan.out
