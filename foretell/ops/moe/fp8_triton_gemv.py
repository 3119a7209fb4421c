"""Fused MoE over FP8 experts for a few tokens (decode, verify, draft): DeepSeek-V3/R1 and Kimi-K2's
routed (and packed shared) experts as they ship, float8_e4m3fn with float32 scales per (QBLOCK_N,
QBLOCK_K) block (fp8_reference.py), read in 8 bits and scaled in-kernel.

The same two GEMV kernels as the bf16 path (triton_gemv.py: read its docstring for the grids, the
slot split of the down kernel and its counters) and the int4 one (triton_int4_gemv.py), with the
weight tiles read as FP8 (all that does not read weights is gemv_common.py's):
  - a [BLOCK_N, BLOCK_K] weight tile is BLOCK_N * BLOCK_K bytes (half the bf16 tile);
  - SCALE_X (the default where a program's rows lie in one block row: every published checkpoint's
    128 x 128 blocks with the default tiles): the block row's scales go onto x, once a tile for
    all the program's rows (x[k] * s[k // QBLOCK_K], float32), the weights are converted and
    multiplied unscaled, and the products are summed per row and column lane across the tiles,
    then across lanes once at the end. The weights enter as q * s unrounded, where the twin
    rounds each to the model dtype (a relative 2^-9 per weight in bf16, averaging out in the
    sums; the int4 kernels do the same). Read as sm_90 builds, about half the loop's
    instructions of the per-weight form below (docs/perf-log.md, 2026-12-04);
  - SCALE_X off (or rows spanning block rows): each element is multiplied by its block's scale
    (one float32 per row of the tile and SUB = min(BLOCK_K, QBLOCK_K) columns) and rounded to the
    model dtype (the weights of a checkpoint dequantized to it), the tile's products summed across
    lanes per tile;
  - either way the bf16 kernels' other roundings stay (projection, silu, product; each expert's
    output before its routing weight).

Twin: fp8_experts_forward_torch (fp8_reference.py) plus the shared output. Grids are fixed by
shapes and the launch config and nothing is read on the host, so the forward can be captured in a
CUDA graph. Tiles: the H200 sweep's winners at DeepSeek-V3's shapes (H = 7168, I = 2048, 8 + 1 of
257 experts; fp8_launch_config). This module imports triton: CUDA (or the interpreter tests,
tests/ops/test_fp8_moe.py) only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.moe.fp8_reference import check_fp8_experts
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
def _fp8_tile(w_rows, scale_rows, k0, row_valid, K, num_scale_cols,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK_K: tl.constexpr, SUB: tl.constexpr,
              dtype: tl.constexpr):
    """The dequantized weights [BLOCK_N, BLOCK_K] (float32 holding values of dtype) at columns
    k0 .. k0 + BLOCK_K of the rows starting at w_rows [BLOCK_N, 1], whose block scales start at
    scale_rows [BLOCK_N, 1]; columns past K come out as 0."""
    GROUPS: tl.constexpr = BLOCK_K // SUB
    k = k0 + tl.arange(0, BLOCK_K)
    q = tl.load(w_rows + k[None, :], mask=row_valid[:, None] & (k < K)[None, :], other=0.0,
                eviction_policy="evict_first").to(tl.float32)  # [BLOCK_N, BLOCK_K]
    group = (k0 + tl.arange(0, GROUPS) * SUB) // QBLOCK_K
    scales = tl.load(scale_rows + group[None, :], mask=row_valid[:, None] & (group < num_scale_cols)[None, :],
                     other=0.0)  # [BLOCK_N, GROUPS] float32
    w = tl.reshape(q, [BLOCK_N, GROUPS, SUB]) * scales[:, :, None]
    return tl.reshape(w.to(dtype).to(tl.float32), [BLOCK_N, BLOCK_K])


@triton.jit
def _fp8_rows(w_rows, k, row_valid, K):
    """The FP8 weights [BLOCK_N, BLOCK_K] at columns k [BLOCK_K] of the rows starting at w_rows
    [BLOCK_N, 1], as float32, unscaled; columns past K come out as 0."""
    return tl.load(w_rows + k[None, :], mask=row_valid[:, None] & (k < K)[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _x_scaled(x, k, K, scale_row, QBLOCK_K: tl.constexpr):
    """x [BLOCK_K] float32 at columns k times its column block's scale in scale_row (the scales of
    the block row that all of a program's rows lie in): SCALE_X's x, once a tile for all rows."""
    return x * tl.load(scale_row + k // QBLOCK_K, mask=k < K, other=0.0)


@triton.jit
def _fp8_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w_ptr,  # [E, 2 * inter, hidden] float8e4nv: gate rows then up rows
    scale_ptr,  # [E, cdiv(2 * inter, QBLOCK_N), cdiv(hidden, QBLOCK_K)] float32
    ids_ptr,  # [num_pairs] expert of each (token, k) pair
    act_ptr,  # [num_pairs, inter] out, the model dtype
    counters_ptr,  # [num_counters] int32, zeroed here for the down kernel (when ZERO_COUNTERS)
    num_counters,
    hidden,
    inter,
    stride_x,
    stride_w_expert,
    stride_scale_expert,
    stride_act,
    TOP_K: tl.constexpr,
    ZERO_COUNTERS: tl.constexpr,
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    SCALE_X: tl.constexpr,  # the program's gate rows share one block row, its up rows another
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
    num_scale_cols = tl.cdiv(hidden, QBLOCK_K)
    gate_rows = cols[:, None].to(tl.int64)
    up_rows = (cols + inter)[:, None].to(tl.int64)  # row I + j of [gate; up] is up's row j
    w_expert = w_ptr + expert * stride_w_expert
    s_expert = scale_ptr + expert * stride_scale_expert
    gate_w, up_w = w_expert + gate_rows * hidden, w_expert + up_rows * hidden
    gate_s = s_expert + (gate_rows // QBLOCK_N) * num_scale_cols
    up_s = s_expert + (up_rows // QBLOCK_N) * num_scale_cols
    dtype = act_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    if SCALE_X:  # per row and column lane, summed once after the loop
        first = tl.program_id(1) * BLOCK_N
        gate_scales = s_expert + (first // QBLOCK_N) * num_scale_cols  # the gate rows' block row
        up_scales = s_expert + ((first + inter) // QBLOCK_N) * num_scale_cols
        gate_lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up_lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_ptr + token * stride_x + k, mask=k < hidden, other=0.0).to(dtype).to(tl.float32)
            gate_lanes = tl.fma(_fp8_rows(gate_w, k, col_valid, hidden),
                                _x_scaled(x, k, hidden, gate_scales, QBLOCK_K)[None, :], gate_lanes)
            up_lanes = tl.fma(_fp8_rows(up_w, k, col_valid, hidden),
                              _x_scaled(x, k, hidden, up_scales, QBLOCK_K)[None, :], up_lanes)
        _store_silu_product(tl.sum(gate_lanes, axis=1), tl.sum(up_lanes, axis=1), act_ptr, pair, stride_act, cols,
                            col_valid)
        return
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + token * stride_x + k, mask=k < hidden, other=0.0).to(dtype).to(tl.float32)
        w_gate = _fp8_tile(gate_w, gate_s, k0, col_valid, hidden, num_scale_cols, BLOCK_N, BLOCK_K, QBLOCK_K, SUB,
                           dtype)
        gate += tl.sum(w_gate * x[None, :], axis=1)
        w_up = _fp8_tile(up_w, up_s, k0, col_valid, hidden, num_scale_cols, BLOCK_N, BLOCK_K, QBLOCK_K, SUB, dtype)
        up += tl.sum(w_up * x[None, :], axis=1)
    _store_silu_product(gate, up, act_ptr, pair, stride_act, cols, col_valid)


@triton.jit
def _fp8_down_slot(
    act_ptr, w_ptr, scale_ptr, ids_ptr, weights_ptr, pair, cols, col_valid, inter, stride_act,
    stride_w_expert, stride_scale_expert, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr, SUB: tl.constexpr,
    SCALE_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One slot's weighted output for BLOCK_N columns: round(W_down[e] . act[pair]) * weight."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    num_scale_cols = tl.cdiv(inter, QBLOCK_K)
    rows = cols[:, None].to(tl.int64)
    w_rows = w_ptr + expert * stride_w_expert + rows * inter
    s_rows = scale_ptr + expert * stride_scale_expert + (rows // QBLOCK_N) * num_scale_cols
    dtype = act_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    if SCALE_X:  # the columns share one block row of W_down: its scales go onto act, once a tile
        row_scales = scale_ptr + expert * stride_scale_expert + (tl.min(cols, axis=0) // QBLOCK_N) * num_scale_cols
        lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + ks
            a = tl.load(act_ptr + pair * stride_act + k, mask=k < inter, other=0.0).to(tl.float32)  # [BLOCK_K]
            scaled = _x_scaled(a, k, inter, row_scales, QBLOCK_K)
            lanes = tl.fma(_fp8_rows(w_rows, k, col_valid, inter), scaled[None, :], lanes)
        return tl.sum(lanes, axis=1).to(dtype).to(tl.float32) * tl.load(weights_ptr + pair)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        a = tl.load(act_ptr + pair * stride_act + k, mask=k < inter, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = _fp8_tile(w_rows, s_rows, k0, col_valid, inter, num_scale_cols, BLOCK_N, BLOCK_K, QBLOCK_K, SUB, dtype)
        y += tl.sum(w * a[None, :], axis=1)
    return y.to(dtype).to(tl.float32) * tl.load(weights_ptr + pair)


@triton.jit
def _fp8_down_combine_kernel(
    act_ptr,  # [num_pairs, inter]
    w_ptr,  # [E, hidden, inter] float8e4nv
    scale_ptr,  # [E, cdiv(hidden, QBLOCK_N), cdiv(inter, QBLOCK_K)] float32
    ids_ptr,  # [num_pairs]
    weights_ptr,  # [num_pairs] float32 routing weights
    shared_ptr,  # [num_tokens, hidden] (read when HAS_SHARED)
    scratch_ptr,  # [num_pairs, hidden] float32 weighted slot outputs (GROUPS > 1)
    counters_ptr,  # [num_tokens, cdiv(hidden, BLOCK_N)] int32, zero on entry (GROUPS > 1)
    out_ptr,  # [num_tokens, hidden] out
    hidden,
    inter,
    stride_act,
    stride_w_expert,
    stride_scale_expert,
    stride_shared,
    stride_out,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # slots per program
    GROUPS: tl.constexpr,  # programs per (token, column block): cdiv(TOP_K, SLOTS)
    HAS_SHARED: tl.constexpr,
    QBLOCK_N: tl.constexpr,
    QBLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    SCALE_X: tl.constexpr,  # a program's columns (rows of W_down) share one block row
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token, col_block, group, cols, col_valid = _down_program(hidden, BLOCK_N)
    if GROUPS == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # slot order, as the twin sums
            acc += _fp8_down_slot(act_ptr, w_ptr, scale_ptr, ids_ptr, weights_ptr, token * TOP_K + k, cols, col_valid,
                                  inter, stride_act, stride_w_expert, stride_scale_expert, QBLOCK_N, QBLOCK_K, SUB,
                                  SCALE_X, BLOCK_N, BLOCK_K)
        _store_token(acc, shared_ptr, out_ptr, token, cols, col_valid, stride_shared, stride_out, HAS_SHARED)
    else:
        for j in tl.static_range(SLOTS):
            slot = group * SLOTS + j
            if slot < TOP_K:
                pair = token * TOP_K + slot
                value = _fp8_down_slot(act_ptr, w_ptr, scale_ptr, ids_ptr, weights_ptr, pair, cols, col_valid, inter,
                                       stride_act, stride_w_expert, stride_scale_expert, QBLOCK_N, QBLOCK_K, SUB,
                                       SCALE_X, BLOCK_N, BLOCK_K)
                tl.store(scratch_ptr + pair * hidden + cols, value, mask=col_valid)
        _combine_split_slots(scratch_ptr, counters_ptr, shared_ptr, out_ptr, token, col_block, cols, col_valid, hidden,
                             stride_shared, stride_out, TOP_K, GROUPS, HAS_SHARED, BLOCK_N)


def fp8_launch_config(num_tokens: int, top_k: int) -> dict:
    """The H200's best at DeepSeek-V3's shapes (8 + 1 of 257 experts, one layer in a CUDA graph,
    2026-12-04, scripts/check_low_precision_gpu.py fp8_moe_configs), at 1 and at 4 tokens: block
    scales on x (SCALE_X), gate_up 16 rows a program over 512-column tiles and eight warps, the
    down kernel 8 columns over 512 and four warps, the slots spread over at most 8 programs a
    column block (V3's 9 slots: 5 programs of 2). The per-weight scaled kernels (SCALE_X off)
    were fastest at 8 rows of 512 on eight warps (256 columns on four at more tokens) and a
    down kernel of 16 x 256 on four (the figures: docs/perf-log.md)."""
    return {
        "gate_up": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "SCALE_X": True},
        "down": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "SPLIT": min(max(top_k, 1), 8), "SCALE_X": True},
    }


def candidate_configs(num_tokens: int, top_k: int) -> list[dict]:
    """Whole configs for an in-graph sweep: the per-weight scaled kernels (SCALE_X off) at their
    best tiles, and the SCALE_X kernels' tiles around the default."""
    default = fp8_launch_config(num_tokens, top_k)
    one = num_tokens == 1
    configs = [{"gate_up": {"BLOCK_N": 8, "BLOCK_K": 512 if one else 256, "num_warps": 8 if one else 4,
                            "SCALE_X": False},
                "down": {**default["down"], "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "SCALE_X": False}}]
    for rows, columns, warps in ((16, 512, 8), (16, 1024, 8), (32, 512, 8), (16, 512, 4), (32, 256, 8)):
        for down_rows, down_columns, down_warps in ((8, 512, 4), (8, 1024, 4), (8, 512, 2), (4, 1024, 4)):
            configs.append({"gate_up": {**default["gate_up"], "BLOCK_N": rows, "BLOCK_K": columns, "num_warps": warps},
                            "down": {**default["down"], "BLOCK_N": down_rows, "BLOCK_K": down_columns,
                                     "num_warps": down_warps}})
    return [c for c in configs if c != default]


def kernel_block_ok(block: tuple[int, int]) -> bool:
    """The kernels take blocks whose width is a power of two (every published checkpoint: 128)."""
    return block[1] >= 1 and block[1] & (block[1] - 1) == 0


def _resolve(config: dict | None, num_tokens: int, top_k: int) -> dict:
    resolved = override_kernel_configs(fp8_launch_config(num_tokens, top_k), config, "FP8 MoE", ("SCALE_X",))
    for name, cfg in resolved.items():
        if cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) or cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1):
            raise ValueError(f"FP8 MoE {name}: BLOCK_K and BLOCK_N must be powers of two, got {cfg}")
    return resolved


def fused_fp8_experts_gemv_triton(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up: torch.Tensor,  # [E, 2 * I, H] float8_e4m3fn
    gate_up_scale: torch.Tensor,  # [E, ceil(2I / b0), ceil(H / b1)] float32
    down: torch.Tensor,  # [E, H, I] float8_e4m3fn
    down_scale: torch.Tensor,  # [E, ceil(H / b0), ceil(I / b1)] float32
    block: tuple[int, int],  # (b0, b1), b1 a power of two
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int
    shared: torch.Tensor | None = None,  # [num_tokens, H]: added (the shared experts' output)
    out_dtype: torch.dtype | None = None,  # None: hidden's
    config: dict | None = None,  # {"gate_up": {...}, "down": {...}} overrides of fp8_launch_config
) -> torch.Tensor:  # [num_tokens, H] out_dtype: the top_k experts' sum (+ shared)
    """fp8_experts_forward_torch (+ shared) in two launches, reading each expert's FP8 bytes once."""
    num_tokens, top_k, hidden_size, inter = check_fp8_experts(
        hidden, gate_up, gate_up_scale, down, down_scale, block, weights, ids, shared)
    if not kernel_block_ok(block):
        raise ValueError(f"the FP8 MoE kernels need a power-of-two block width, got {list(block)}")
    out_dtype = out_dtype or hidden.dtype
    if num_tokens * top_k == 0:
        return no_pairs_output(num_tokens, hidden_size, shared, out_dtype, hidden.device)
    cfg = _resolve(config, num_tokens, top_k)
    up_cfg, down_cfg = cfg["gate_up"], cfg["down"]
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    gate_up, gate_up_scale, down, down_scale = (t.contiguous() for t in (gate_up, gate_up_scale, down, down_scale))
    plan = plan_gemv(hidden, weights, ids, shared, inter, hidden.dtype, out_dtype, down_cfg["SPLIT"],
                     down_cfg["BLOCK_N"])
    b0, b1 = block
    # SCALE_X where a program's rows lie in one block row (every published checkpoint's 128 x 128)
    up_opts = {**launch_options(up_cfg), "SCALE_X": up_cfg["SCALE_X"] and b0 % up_cfg["BLOCK_N"] == 0
               and inter % up_cfg["BLOCK_N"] == 0}
    down_opts = {**launch_options(down_cfg), "SCALE_X": down_cfg["SCALE_X"] and b0 % down_cfg["BLOCK_N"] == 0}
    _fp8_gate_up_kernel[plan.gate_up_grid(up_cfg["BLOCK_N"])](
        hidden, gate_up, gate_up_scale, plan.flat_ids, plan.act, plan.counters, plan.num_counters,
        hidden_size, inter, hidden.stride(0), gate_up.stride(0), gate_up_scale.stride(0), plan.act.stride(0),
        QBLOCK_N=b0, QBLOCK_K=b1, SUB=min(up_cfg["BLOCK_K"], b1), **plan.gate_up_constexprs, **up_opts,
    )
    _fp8_down_combine_kernel[plan.down_grid](
        plan.act, down, down_scale, plan.flat_ids, plan.pair_weights, plan.shared_or_out, plan.scratch,
        plan.counters, plan.out, hidden_size, inter, plan.act.stride(0), down.stride(0), down_scale.stride(0),
        plan.stride_shared, plan.out.stride(0),
        QBLOCK_N=b0, QBLOCK_K=b1, SUB=min(down_cfg["BLOCK_K"], b1), **plan.down_constexprs, **down_opts,
        enable_fp_fusion=False,  # each weighted slot output rounded to float32 before it is added
    )
    return plan.out
