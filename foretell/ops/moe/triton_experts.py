"""Fused MoE on the GPU: the routed (token, expert) pairs grouped by expert into blocks of
BLOCK_M rows, then two grouped GEMM kernels that read only the selected experts' weights.
`fused_experts_triton` is the entry point of both paths: up to GEMV_MAX_TOKENS tokens (decode,
verify) it runs the GEMV path of triton_gemv.py instead (no align, no combine launch; same
contract, same rounding, same slot order in the float32 sum); `path` forces one or the other.

Twin: `experts_forward_torch` in reference.py (same inputs, same float32 output, the same points of
rounding to the model dtype); `moe_align_torch` here is the twin of the align kernel.
tests/ops/test_moe_experts.py holds them together on random routings in Triton's interpreter,
tests/gpu/test_mla_moe_gpu.py on CUDA in bf16.

  align     ids [T, top_k] -> pairs sorted by expert (stable: token order within an expert),
            each expert's run padded to a whole number of BLOCK_M blocks; per block its expert
            (num_experts past the last used block) and how many of its rows are real.
  gate_up   per block and BLOCK_N columns: x[token] @ W_gate[e]^T and @ W_up[e]^T, then
            silu(gate) * up -> act [max_blocks * BLOCK_M, I] in block order.
  down      per block and BLOCK_N columns: act @ W_down[e]^T, times the pair's routing weight
            -> out_pairs [T * top_k, H] float32 at the pair's own row (no atomics)
  combine   per token: the sum over its top_k rows in order k = 0, 1, ... (deterministic), plus
            the shared experts' output when given, in float32, cast to the output dtype once.

Every grid is fixed by shapes: at most (P + min(E, P) * (BLOCK_M - 1)) / BLOCK_M blocks for
P = T * top_k pairs, and blocks past the used ones return at once. Nothing reads a device value
on the host, so the whole forward can be captured in a CUDA graph. Up to ALIGN_KERNEL_MAX_PAIRS
pairs the align step is one single-program Triton kernel (decode and verify: one launch instead
of a chain of small torch ops); larger batches (prefill) use the torch twin, also sync-free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.moe.gemv_common import no_pairs_output
from foretell.ops.moe.triton_gemv import (
    GEMV_MAX_TOKENS,
    check_expert_inputs,
    launch_gemv_experts,
)

ALIGN_KERNEL_MAX_PAIRS = 16384
PATHS = ("gemv", "grouped")


@triton.jit
def _moe_align_kernel(
    ids_ptr,  # [num_pairs] expert of each (token, k) pair
    sorted_pair_ptr,  # [max_blocks * BLOCK_M] int32 out: pair index per row (padding rows unset)
    block_expert_ptr,  # [max_blocks] int32 out: expert, or >= NUM_EXPERTS past the used blocks
    block_rows_ptr,  # [max_blocks] int32 out: real rows in the block
    num_pairs,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, EXPERTS_P)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_P], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        e = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_ends = tl.cumsum(blocks, axis=0)  # experts past NUM_EXPERTS have no blocks
    block_starts = block_ends - blocks

    for start in range(0, max_blocks, CHUNK):
        b = start + lanes
        # A block's expert is the number of experts whose blocks end at or before it.
        expert = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        own = experts[None, :] == expert[:, None]
        count = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        first = tl.sum(tl.where(own, block_starts[None, :], 0), axis=1)
        rows = tl.minimum(tl.maximum(count - (b - first) * BLOCK_M, 0), BLOCK_M)
        tl.store(block_expert_ptr + b, tl.minimum(expert, NUM_EXPERTS), mask=b < max_blocks)
        tl.store(block_rows_ptr + b, rows, mask=b < max_blocks)

    taken = tl.zeros([EXPERTS_P], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pair = start + lanes
        e = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS_P]
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in this chunk
        dest = tl.sum(onehot * (before + taken[None, :] + block_starts[None, :] * BLOCK_M), axis=1)
        tl.store(sorted_pair_ptr + dest, pair, mask=pair < num_pairs)
        taken += tl.sum(onehot, axis=0)


def moe_align_torch(
    flat_ids: torch.Tensor,  # [num_pairs] int, expert of each (token, k) pair
    num_experts: int,
    block_m: int,
    max_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of the align kernel: (sorted_pair [max_blocks * block_m], block_expert [max_blocks],
    block_rows [max_blocks]), int32. Padding rows of sorted_pair hold 0. No host sync."""
    device = flat_ids.device
    num_pairs = flat_ids.numel()
    ids = flat_ids.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would sync for its size
    blocks = (counts + block_m - 1) // block_m
    block_ends = blocks.cumsum(0)
    block_starts = block_ends - blocks
    order = ids.argsort(stable=True)
    sorted_experts = ids[order]
    pair_starts = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=device) - pair_starts[sorted_experts]
    dest = block_starts[sorted_experts] * block_m + rank
    sorted_pair = torch.zeros(max_blocks * block_m, dtype=torch.int64, device=device)
    sorted_pair.scatter_(0, dest, order)
    b = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_ends, b, right=True)  # num_experts past the end
    own = block_expert.clamp(max=num_experts - 1)
    rows = (counts[own] - (b - block_starts[own]) * block_m).clamp(0, block_m)
    rows = torch.where(block_expert < num_experts, rows, 0)
    return sorted_pair.int(), block_expert.int(), rows.int()


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w_ptr,  # [E, 2 * inter, hidden]: gate rows then up rows
    act_ptr,  # [max_blocks * BLOCK_M, inter] out, block order
    sorted_pair_ptr,
    block_expert_ptr,
    block_rows_ptr,
    hidden,
    inter,
    stride_x,
    stride_w_expert,
    stride_w_row,
    stride_act,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    num_rows = tl.load(block_rows_ptr + block)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < num_rows
    pair = tl.load(sorted_pair_ptr + block * BLOCK_M + rows, mask=row_valid, other=0)
    token = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * stride_w_row + ks[:, None]
    up_ptrs = gate_ptrs + inter * stride_w_row
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_valid = ks + k0 < hidden
        x = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        x = x.to(w_gate.dtype)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    # Round where the twin does: the projection, silu(gate), then the product.
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    act_ptrs = act_ptr + (block * BLOCK_M + rows)[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(act_ptrs, (silu * up).to(dtype), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [max_blocks * BLOCK_M, inter], block order
    w_ptr,  # [E, hidden, inter]
    out_ptr,  # [num_pairs, hidden] float32 out
    weights_ptr,  # [num_pairs] float32 routing weights
    sorted_pair_ptr,
    block_expert_ptr,
    block_rows_ptr,
    hidden,
    inter,
    stride_act,
    stride_w_expert,
    stride_w_row,
    stride_out,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    num_rows = tl.load(block_rows_ptr + block)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < num_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + (block * BLOCK_M + rows)[:, None].to(tl.int64) * stride_act + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * stride_w_row + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_valid = ks + k0 < inter
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    pair = tl.load(sorted_pair_ptr + block * BLOCK_M + rows, mask=row_valid, other=0).to(tl.int64)
    weight = tl.load(weights_ptr + pair, mask=row_valid, other=0.0)
    # The twin rounds the expert's output to the model dtype before weighting it in float32.
    result = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pair[:, None] * stride_out + cols[None, :], result,
             mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _combine_kernel(
    out_pairs_ptr,  # [num_tokens, TOP_K, hidden] float32, contiguous
    shared_ptr,  # [num_tokens, hidden] (read when HAS_SHARED)
    out_ptr,  # [num_tokens, hidden], contiguous
    hidden_size,
    stride_shared,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = cols < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(out_pairs_ptr + (token * TOP_K + k) * hidden_size + cols, mask=valid, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token * stride_shared + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, acc.to(out_ptr.dtype.element_ty), mask=valid)


def moe_launch_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tiles from shapes only. BLOCK_M follows the mean pairs per expert (16 at decode, where
    the kernels are weight-bandwidth bound; up to 64 for prefill)."""
    per_expert = triton.cdiv(num_pairs, num_experts)
    block_m = min(64, max(16, triton.next_power_of_2(per_expert)))
    if dtype.itemsize > 2:  # float32: FMA path, small tiles
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    if block_m == 16:  # near the best of the H200 sweeps at 1-16 tokens (docs/perf-log.md)
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def max_moe_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the padded grouping can need: each used expert wastes under one block."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def fused_experts_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int
    config: dict | None = None,  # launch config overrides of the path that runs (benchmarks sweep these)
    align_kernel: bool | None = None,  # grouped path: None by size (ALIGN_KERNEL_MAX_PAIRS); tests force it
    shared: torch.Tensor | None = None,  # [num_tokens, hidden]: added (the shared experts' output)
    out_dtype: torch.dtype = torch.float32,
    path: str | None = None,  # "gemv" / "grouped"; None: gemv up to GEMV_MAX_TOKENS tokens
) -> torch.Tensor:  # [num_tokens, hidden] out_dtype: the top_k experts' sum (+ shared)
    """The top_k experts of every token, weighted and summed in float32 (+ shared), cast once.
    `config` overrides moe_launch_config (grouped) or gemv_launch_config (gemv). Forcing
    `align_kernel` asks for the grouped path (with path None it selects it)."""
    num_tokens, top_k, hidden_size, inter = check_expert_inputs(hidden, gate_up, down, weights, ids, shared)
    if path is None:
        path = "gemv" if align_kernel is None and num_tokens <= GEMV_MAX_TOKENS else "grouped"
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None, got {path!r}")
    if path == "gemv":
        if align_kernel is not None:
            raise ValueError("align_kernel applies to the grouped path only; got it with path='gemv'")
        return launch_gemv_experts(hidden, gate_up, down, weights, ids, shared, out_dtype, config)
    num_experts = gate_up.shape[0]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return no_pairs_output(num_tokens, hidden_size, shared, out_dtype, hidden.device)
    hidden, gate_up, down = (t if t.stride(-1) == 1 else t.contiguous() for t in (hidden, gate_up, down))
    cfg = {**moe_launch_config(num_pairs, num_experts, gate_up.dtype), **(config or {})}
    block_m = cfg["BLOCK_M"]
    max_blocks = max_moe_blocks(num_pairs, num_experts, block_m)
    flat_ids = ids.reshape(num_pairs)
    if align_kernel is None:
        align_kernel = num_pairs <= ALIGN_KERNEL_MAX_PAIRS
    if align_kernel:
        sorted_pair, block_expert, block_rows = _align(flat_ids, num_experts, block_m, max_blocks)
    else:
        sorted_pair, block_expert, block_rows = moe_align_torch(flat_ids, num_experts, block_m, max_blocks)
    precision = "ieee" if gate_up.dtype == torch.float32 else "tf32"
    common = dict(NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  DOT_PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    act = torch.empty(max_blocks * block_m, inter, dtype=gate_up.dtype, device=hidden.device)
    _gate_up_kernel[(max_blocks, triton.cdiv(inter, cfg["BLOCK_N"]))](
        hidden, gate_up, act, sorted_pair, block_expert, block_rows,
        hidden_size, inter, hidden.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=top_k, **common,
    )
    out_pairs = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    pair_weights = weights.reshape(num_pairs).float().contiguous()
    _down_kernel[(max_blocks, triton.cdiv(hidden_size, cfg["BLOCK_N"]))](
        act, down, out_pairs, pair_weights, sorted_pair, block_expert, block_rows,
        hidden_size, inter, act.stride(0), down.stride(0), down.stride(1), out_pairs.stride(0),
        **common,
    )
    out = torch.empty(num_tokens, hidden_size, dtype=out_dtype, device=hidden.device)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        out_pairs, shared if shared is not None else out, out, hidden_size,
        shared.stride(0) if shared is not None else 0,
        TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK_H=block_h, num_warps=4,
    )
    return out


def _align(flat_ids: torch.Tensor, num_experts: int, block_m: int, max_blocks: int):
    device = flat_ids.device
    sorted_pair = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(max_blocks, dtype=torch.int32, device=device)
    experts_p = triton.next_power_of_2(num_experts)
    # [CHUNK, EXPERTS_P] one-hot tiles of at most 8192 values.
    chunk = max(16, min(triton.next_power_of_2(max(flat_ids.numel(), max_blocks)), 8192 // experts_p))
    _moe_align_kernel[(1,)](
        flat_ids, sorted_pair, block_expert, block_rows, flat_ids.numel(), max_blocks,
        NUM_EXPERTS=num_experts, EXPERTS_P=experts_p, BLOCK_M=block_m, CHUNK=chunk,
        num_warps=4 if chunk * experts_p <= 4096 else 8,
    )
    return sorted_pair, block_expert, block_rows
