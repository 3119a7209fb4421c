"""Fused MoE for a few tokens (decode, verify): two GEMV kernels, no align step, no combine kernel.

At a handful of tokens the grouped path of triton_experts.py spends a launch on grouping the
(token, expert) pairs by expert and another on summing each token's top_k rows, around the two
kernels that stream the experts' weights. With M = 1 row per (token, expert) pair there is
nothing to group: each program reads its pair's expert id itself.

  gate_up   grid (num_pairs, cdiv(I, BLOCK_N)): x[token] . W_gate[e][cols] and . W_up[e][cols],
            float32 partials over K in BLOCK_K chunks (tiles [BLOCK_N, BLOCK_K], K contiguous),
            then silu(gate) * up rounded as the grouped kernel rounds -> act [num_pairs, I].
  down      grid (num_tokens, cdiv(H, BLOCK_N), groups): for the token's slots k = 0, 1, ...:
            y_k = W_down[e_k][cols] . act[pair k], rounded to the model dtype, times the routing
            weight, summed in float32 in slot order (what _down_kernel + _combine_kernel give),
            plus the shared experts' output when given, cast to out_dtype once.

At one token the down kernel has only H / BLOCK_N column blocks (128 at V2-Lite with BLOCK_N 16),
too few programs to keep an H200's HBM busy, so SPLIT > 1 (by default top_k: one slot a program)
spreads a column block's slots over SPLIT programs: each writes its slots' weighted outputs to a
float32 scratch [num_pairs, H] and bumps a per-(token, column block) counter; the last to arrive
sums all top_k slots in slot order. The sum is therefore the same, bit for bit, whatever SPLIT
is: the down kernel is compiled without FMA contraction, so a weighted slot output is rounded to
float32 before it is added, as a stored one is (with contraction, SPLIT 1 and 2 differed in the
last bit on the H200). The counters are zeroed by the gate_up kernel, which runs before on the
same stream, so no memset launch is needed. The steps that do not read the weights (the counters,
the roundings of silu(gate) * up, the split combine, the host's launch plan) are gemv_common.py's,
shared with the FP8 and int4 paths.

Every grid is fixed by shapes and the launch config; nothing reads a device value on the host,
so the forward can be captured in a CUDA graph. Twin: `experts_forward_torch` in reference.py (plus
the shared output); tests/ops/test_moe_gemv.py holds them together in Triton's interpreter,
tests/gpu/test_moe_gemv_gpu.py on CUDA. The tiles and GEMV_MAX_TOKENS come from H200 sweeps
(docs/perf-log.md); `foretell bench kernels --kernels moe` times the path against the torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.moe.gemv_common import (
    _combine_split_slots,
    _down_program,
    _store_silu_product,
    _store_token,
    _zero_counters,
    launch_options,
    no_pairs_output,
    plan_gemv,
)
from foretell.ops.moe.reference import check_routing

# Up to this many tokens fused_experts_triton takes the GEMV path; past it, tokens that share
# experts (the shared ones always) re-read their weights. A first H200 probe at V2-Lite shapes
# (6 + 2 experts, bf16, graph-timed; docs/perf-log.md) had the GEMV ahead of the grouped path up
# to 4 tokens and behind at 8.
GEMV_MAX_TOKENS = 4
KERNEL_KEYS = {
    "gate_up": ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "down": ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT"),
}


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,  # [num_tokens, hidden]
    w_ptr,  # [E, 2 * inter, hidden]: gate rows then up rows
    ids_ptr,  # [num_pairs] expert of each (token, k) pair
    act_ptr,  # [num_pairs, inter] out
    counters_ptr,  # [num_counters] int32, zeroed here for the down kernel (when ZERO_COUNTERS)
    num_counters,
    hidden,
    inter,
    stride_x,
    stride_w_expert,
    stride_w_row,
    stride_act,
    TOP_K: tl.constexpr,
    ZERO_COUNTERS: tl.constexpr,
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
    ks = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * stride_w_expert + cols[:, None] * stride_w_row  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_w_row
    x_row = x_ptr + token * stride_x
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_valid = k < hidden
        w_mask = col_valid[:, None] & k_valid[None, :]
        w_gate = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        # x in the weights' dtype, as the grouped kernel feeds tl.dot.
        x = tl.load(x_row + k, mask=k_valid, other=0.0).to(w_gate.dtype).to(tl.float32)  # [BLOCK_K]
        gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    _store_silu_product(gate, up, act_ptr, pair, stride_act, cols, col_valid)


@triton.jit
def _down_slot(
    act_ptr, w_ptr, ids_ptr, weights_ptr, pair, cols, col_valid, inter, stride_act, stride_w_expert,
    stride_w_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One slot's weighted output for BLOCK_N columns: round(W_down[e] . act[pair]) * weight."""
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_rows = w_ptr + expert * stride_w_expert + cols[:, None] * stride_w_row  # [BLOCK_N, 1]
    act_row = act_ptr + pair * stride_act
    ks = tl.arange(0, BLOCK_K)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        k_valid = k < inter
        a = tl.load(act_row + k, mask=k_valid, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(w_rows + k[None, :], mask=col_valid[:, None] & k_valid[None, :], other=0.0)
        y += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    # The twin rounds the expert's output to the model dtype before weighting it in float32.
    return y.to(act_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + pair)


@triton.jit
def _down_combine_kernel(
    act_ptr,  # [num_pairs, inter]
    w_ptr,  # [E, hidden, inter]
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
    stride_w_row,
    stride_shared,
    stride_out,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # slots per program
    GROUPS: tl.constexpr,  # programs per (token, column block): cdiv(TOP_K, SLOTS)
    HAS_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token, col_block, group, cols, col_valid = _down_program(hidden, BLOCK_N)
    if GROUPS == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # slot order, as the combine kernel sums
            acc += _down_slot(act_ptr, w_ptr, ids_ptr, weights_ptr, token * TOP_K + k, cols, col_valid, inter,
                              stride_act, stride_w_expert, stride_w_row, BLOCK_N, BLOCK_K)
        _store_token(acc, shared_ptr, out_ptr, token, cols, col_valid, stride_shared, stride_out, HAS_SHARED)
    else:
        for j in tl.static_range(SLOTS):
            slot = group * SLOTS + j
            if slot < TOP_K:
                pair = token * TOP_K + slot
                value = _down_slot(act_ptr, w_ptr, ids_ptr, weights_ptr, pair, cols, col_valid, inter,
                                   stride_act, stride_w_expert, stride_w_row, BLOCK_N, BLOCK_K)
                tl.store(scratch_ptr + pair * hidden + cols, value, mask=col_valid)
        _combine_split_slots(scratch_ptr, counters_ptr, shared_ptr, out_ptr, token, col_block, cols, col_valid, hidden,
                             stride_shared, stride_out, TOP_K, GROUPS, HAS_SHARED, BLOCK_N)


def check_expert_inputs(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, top_k]
    ids: torch.Tensor,  # [num_tokens, top_k] int
    shared: torch.Tensor | None,  # [num_tokens, hidden]
) -> tuple[int, int, int, int]:
    """(num_tokens, top_k, hidden_size, inter) of consistent inputs; ValueError naming the
    mismatch otherwise. Expert ids are not range-checked (that would read them on the host)."""
    if (gate_up.dim() != 3 or gate_up.shape[1] % 2 or hidden.dim() != 2
            or down.shape != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2)
            or hidden.shape[-1] != gate_up.shape[2]):
        raise ValueError(
            f"experts do not fit: hidden {tuple(hidden.shape)}, gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)}; expected hidden [T, H], gate_up [E, 2 * I, H], down [E, H, I]"
        )
    num_tokens, hidden_size = hidden.shape
    top_k = check_routing(ids, weights, shared, num_tokens, hidden_size)
    return num_tokens, top_k, hidden_size, gate_up.shape[1] // 2


def gemv_launch_config(num_tokens: int, top_k: int, dtype: torch.dtype) -> dict:
    """{"gate_up": {...}, "down": {...}} from shapes only: BLOCK_K spans one warp's 16-byte loads
    of a row (512 bytes); the down kernel gives each program one slot (SPLIT = top_k).

    From a first probe on the H200 (V2-Lite, bf16, 6 + 2 experts per token, graph-timed whole
    forward; the figures in docs/perf-log.md): gate_up tiles barely matter (16 x 256, 4 x 1024,
    32 x 256 with 8 warps alike; num_stages 1 and 3 equal: Triton does not pipeline these loads);
    the down kernel wants one slot per program (SPLIT = slots; fewer splits or 512-wide tiles were
    slower), with BLOCK_N 16 at 1 token and 32 above."""
    block_k = 512 // dtype.itemsize
    return {
        "gate_up": {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 1},
        "down": {"BLOCK_N": 16 if num_tokens == 1 else 32, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 1,
                 "SPLIT": max(top_k, 1)},
    }


def resolve_gemv_config(default: dict, config: dict | None) -> dict:
    """The default per-kernel configs overridden by `config`: flat keys (BLOCK_N, BLOCK_K,
    num_warps, num_stages; SPLIT) apply to every kernel that has them, then "gate_up" / "down"
    sub-dicts to that kernel only."""
    config = dict(config or {})
    per_kernel = {name: dict(config.pop(name, None) or {}) for name in KERNEL_KEYS}
    known = set().union(*KERNEL_KEYS.values())
    unknown = sorted(set(config) - known) + sorted(
        f"{name}.{key}" for name, keys in KERNEL_KEYS.items() for key in per_kernel[name] if key not in keys)
    if unknown:
        raise ValueError(f"unknown GEMV MoE config keys {unknown}; expected {sorted(known)} at the top level "
                         f"or in 'gate_up' {list(KERNEL_KEYS['gate_up'])} / 'down' {list(KERNEL_KEYS['down'])}")
    resolved = {}
    for name, keys in KERNEL_KEYS.items():
        cfg = {**default[name], **{k: v for k, v in config.items() if k in keys}, **per_kernel[name]}
        for key in ("BLOCK_N", "BLOCK_K"):
            if cfg[key] < 1 or cfg[key] & (cfg[key] - 1):
                raise ValueError(f"GEMV MoE {name} {key} must be a power of two, got {cfg[key]}")
        if cfg.get("SPLIT", 1) < 1:
            raise ValueError(f"GEMV MoE down SPLIT must be >= 1, got {cfg['SPLIT']}")
        resolved[name] = cfg
    return resolved


def fused_experts_gemv_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int
    shared: torch.Tensor | None = None,  # [num_tokens, hidden]: added (the shared experts' output)
    out_dtype: torch.dtype = torch.float32,
    config: dict | None = None,  # overrides of gemv_launch_config (see resolve_gemv_config)
) -> torch.Tensor:  # [num_tokens, hidden] out_dtype: the top_k experts' sum (+ shared)
    """The contract of triton_experts.fused_experts_triton, computed by the two GEMV kernels."""
    check_expert_inputs(hidden, gate_up, down, weights, ids, shared)
    return launch_gemv_experts(hidden, gate_up, down, weights, ids, shared, out_dtype, config)


def launch_gemv_experts(hidden, gate_up, down, weights, ids, shared, out_dtype, config) -> torch.Tensor:
    """fused_experts_gemv_triton on inputs check_expert_inputs has accepted."""
    num_tokens, top_k = ids.shape
    hidden_size, inter = gate_up.shape[2], gate_up.shape[1] // 2
    if num_tokens * top_k == 0:
        return no_pairs_output(num_tokens, hidden_size, shared, out_dtype, hidden.device)
    cfg = resolve_gemv_config(gemv_launch_config(num_tokens, top_k, gate_up.dtype), config)
    up_cfg, down_cfg = cfg["gate_up"], cfg["down"]
    hidden, gate_up, down = (t if t.stride(-1) == 1 else t.contiguous() for t in (hidden, gate_up, down))
    plan = plan_gemv(hidden, weights, ids, shared, inter, gate_up.dtype, out_dtype, down_cfg["SPLIT"],
                     down_cfg["BLOCK_N"])
    _gate_up_gemv_kernel[plan.gate_up_grid(up_cfg["BLOCK_N"])](
        hidden, gate_up, plan.flat_ids, plan.act, plan.counters, plan.num_counters,
        hidden_size, inter, hidden.stride(0), gate_up.stride(0), gate_up.stride(1), plan.act.stride(0),
        **plan.gate_up_constexprs, **launch_options(up_cfg),
    )
    _down_combine_kernel[plan.down_grid](
        plan.act, down, plan.flat_ids, plan.pair_weights, plan.shared_or_out, plan.scratch, plan.counters, plan.out,
        hidden_size, inter, plan.act.stride(0), down.stride(0), down.stride(1), plan.stride_shared,
        plan.out.stride(0), **plan.down_constexprs, **launch_options(down_cfg),
        enable_fp_fusion=False,  # no FMA: each weighted slot output is rounded, as stored ones are
    )
    return plan.out
