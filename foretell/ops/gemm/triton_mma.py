"""A tensor-core linear for a few rows: y = x W^T (+ b) for x [M, K] with 1 <= M <= 16, W [N, K].

A verify step at batch 1 (k + 1 = 4 tokens) or a decode step at a small batch reads every weight
once for a handful of rows. The batch-1 GEMV (ops/gemm/triton_gemv.py) pays one pass of float32
FMAs per row and loses to cuBLAS from two rows on; this kernel puts the rows on tensor cores the
"swapped" way round, so the weights are the big operand of the MMA:
  - program (p, s) owns BLOCK_N = 64 rows of W (a Hopper wgmma tile of M = 64) and the s-th of
    SPLIT slices of K; it multiplies [BLOCK_N, BLOCK_K] weight tiles by x^T tiles [BLOCK_K, 16]
    (x's rows padded to 16 columns, masked), the tile loads pipelined by Triton (num_stages);
  - programmatic dependent launch (ops/common/pdl.py), as the GEMV: the first weight tile is
    requested before waiting for the kernel before it, and the next kernel may launch once this
    program's reads are done;
  - split-K for layers with few tiles (Llama's o and down projections have 64): each split stores
    a float32 partial; the split that arrives last at the tile's counter (an atomic, acquire-
    release) adds the partials up in split order, so the result does not depend on which finished
    first, adds the bias, stores y and zeroes the counter for the next launch;
  - `gated` (W = [gate; up]): each tile's rows are (gate j, up j) pairs and its epilogue stores
    silu(gate) * up, as the GEMV's; `float32_out` stores the rounded results as float32.

On the H200 at M = 4 each Llama-8B layer kind ran at least as fast as cuBLAS (the times:
docs/perf-log.md, the eighth GPU session's tensor-core sweep; mode "on"'s choices are made in the
verify graph: ops/gemm/triton_kernels.py). Loading W through a tensor descriptor (TMA) was no
faster.

fp16 and bf16 only (tensor-core inputs; float32 layers keep cuBLAS's exact products). Grids depend
only on shapes, nothing syncs with the host, partials are a torch.empty of the launch, and the
counters are allocated at the first (eager) launch, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel
from foretell.ops.common.split_counters import SplitCounters
from foretell.ops.gemm.triton_gemv import check_inputs, program_rows_of_w, silu_mul_rounded

MAX_M = 16  # x's rows, padded to this many columns of the MMA
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
BLOCK_N = 64  # rows of W per program: one wgmma tile
DEFAULT_SMEM_BYTES = 99 << 10  # when the device does not say (the interpreter)
# One per process (launches run in stream order, each leaves its counters zero); a counter per
# 64-row tile: 1 << 16 covers a vocabulary of 4M rows.
_COUNTERS = SplitCounters(min_count=1 << 16)


@dataclass(frozen=True)
class MmaConfig:
    block_k: int  # columns of W per pipelined tile
    split: int  # slices of K, each its own program
    num_stages: int  # tiles in flight per program
    block_n: int = BLOCK_N
    num_warps: int = 4

    def __str__(self) -> str:  # for logs and benchmark tables
        return f"mma BN{self.block_n} BK{self.block_k} split{self.split} s{self.num_stages} w{self.num_warps}"


@functools.cache
def _device_limits(device_index: int) -> tuple[int, int]:
    """(multiprocessors, shared memory bytes a program may opt into) of a CUDA device."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SMEM_BYTES
    return props.multi_processor_count, smem


def device_limits(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 132, DEFAULT_SMEM_BYTES  # the interpreter: an H100-sized grid, any tile fits
    return _device_limits(device.index if device.index is not None else torch.cuda.current_device())


def _stages_that_fit(block_n: int, block_k: int, smem_bytes: int, wanted: int = 4) -> int:
    """Pipeline depth whose shared memory fits: Triton keeps num_stages + 1 bf16 tiles of W and x^T."""
    per_stage = (block_n + MAX_M) * block_k * 2
    return max(1, min(wanted, smem_bytes // per_stage - 1))


def pick_config(m: int, n: int, k: int, device: torch.device) -> MmaConfig:
    """Tiles for an [m, k] x [n, k]^T product (H200 sweep at M = 1 and 4): layers with at most
    half as many 64-row tiles as multiprocessors split K four ways (o, down: 64 tiles), the rest
    run whole rows of K, in 256-wide tiles while they have fewer tiles than multiprocessors (qkv);
    a K of 8192 or more with fewer tiles than multiprocessors (an EAGLE3 head's qkv) splits in two."""
    if not 1 <= m <= MAX_M or n < 1 or k < 1:
        raise ValueError(f"small-M MMA needs 1 <= M <= {MAX_M}, N >= 1, K >= 1; got M={m}, N={n}, K={k}")
    sms, smem = device_limits(device)
    tiles = triton.cdiv(n, BLOCK_N)
    if 2 * tiles <= sms and k >= 4 * 128:
        split = 4
    else:
        split = 2 if tiles < sms and k >= 8192 else 1
    block_k = 256 if split == 1 and tiles < sms else 128
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return MmaConfig(block_k, split, _stages_that_fit(BLOCK_N, block_k, smem))


def candidate_configs(m: int, n: int, k: int, device: torch.device) -> list[MmaConfig]:
    """pick_config first, then the other split and tile widths (what a timing dispatch tries)."""
    best = pick_config(m, n, k, device)
    _, smem = device_limits(device)
    others = [MmaConfig(block_k, split, _stages_that_fit(BLOCK_N, block_k, smem))
              for block_k, split in ((128, 1), (256, 1), (128, 2), (128, 4)) if block_k <= max(16, k)]
    return list(dict.fromkeys([best, *others]))


@triton.jit
def _mma_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous ([M, N // 2] with GATED), x's dtype or float32
    partial_ptr,  # [SPLIT, M, N] float32 (unused when SPLIT == 1)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero (unused when SPLIT == 1)
    M,
    N,
    K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # W is [gate; up] (N = 2I rows): out [M, I] = silu(x gate^T) * (x up^T)
    PDL: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cols, col_ok = program_rows_of_w(tile, N, BLOCK_N, GATED)  # output columns = rows of W
    rows = tl.arange(0, BLOCK_M)  # rows of x
    row_ok = rows < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    lanes = k_start + tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows[None, :] * stride_xm + lanes[:, None]  # [BLOCK_K, BLOCK_M]
    # No kernel of a step writes W: its first tile is requested before the wait (ops/common/pdl.py).
    w = tl.load(w_tile, mask=col_ok[:, None] & (lanes < k_end)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    x = tl.load(x_tile, mask=(lanes < k_end)[:, None] & row_ok[None, :], other=0.0)
    acc = tl.dot(w, x)  # [BLOCK_N, BLOCK_M] float32
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        k_ok = (lanes + k0) < k_end
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_tile + k0, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    let_next_kernel_launch(PDL)  # this program's reads of W are done

    out_mask = col_ok[:, None] & row_ok[None, :]
    offsets = rows[None, :] * N + tile * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BLOCK_N, BLOCK_M] partials
    if SPLIT > 1:
        tl.store(partial_ptr + split * M * N + offsets, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last split of this tile: every partial is visible now
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(SPLIT):  # split order: the same sum whichever split finished last
                acc += tl.load(partial_ptr + s * M * N + offsets, mask=out_mask, other=0.0, cache_modifier=".cg")
            store_output(acc, bias_ptr, cols, col_ok, out_ptr, rows, row_ok, tile, N,
                          HAS_BIAS, GATED, BLOCK_N, BLOCK_M, x_ptr.dtype.element_ty)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch
    else:
        store_output(acc, bias_ptr, cols, col_ok, out_ptr, rows, row_ok, tile, N,
                      HAS_BIAS, GATED, BLOCK_N, BLOCK_M, x_ptr.dtype.element_ty)


@triton.jit
def store_output(acc, bias_ptr, cols, col_ok, out_ptr, rows, row_ok, tile, N,
                  HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  dtype: tl.constexpr):
    """Store acc [BLOCK_N, BLOCK_M] (rows of W x rows of x) as out[rows, cols] (+ bias), rounded to
    dtype (x's); GATED: rows of W are (gate j, up j) pairs, and out [M, N // 2] takes silu(gate) * up
    per pair."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out_dtype = out_ptr.dtype.element_ty  # results round to dtype (a float32 out holds them as they are)
    if GATED:
        pairs = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_N // 2, 2, BLOCK_M]), (0, 2, 1))
        gate, up = tl.split(pairs)  # [BLOCK_N // 2, BLOCK_M] each
        acts = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = (acts < N // 2)[:, None] & row_ok[None, :]
        tl.store(out_ptr + rows[None, :] * (N // 2) + acts[:, None], silu_mul_rounded(gate, up, dtype).to(out_dtype),
                 mask=mask)
    else:
        tl.store(out_ptr + rows[None, :] * N + cols[:, None], acc.to(dtype).to(out_dtype),
                 mask=col_ok[:, None] & row_ok[None, :])


def small_m_mma_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_M; any row stride
    weight: torch.Tensor,  # [N, K], x's dtype (fp16 / bf16), contiguous
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: MmaConfig | None = None,  # None: pick_config's choice
    gated: bool = False,  # weight is [gate; up]: return silu(gate) * up of F.linear's output
    float32_out: bool = False,  # the same values (rounded to x's dtype) in a float32 tensor
) -> torch.Tensor:  # [M, N] contiguous, x's dtype ([M, N // 2] when gated; float32 if asked)
    """F.linear(x, weight, bias) for up to 16 rows on tensor cores, reading weight exactly once."""
    check_inputs(x, weight, bias, "small-M MMA (tensor-core inputs)", SUPPORTED_DTYPES, MAX_M, gated)
    m = x.shape[0]
    n, k = weight.shape
    config = config or pick_config(m, n, k, x.device)
    if gated and config.block_n % 2:
        raise ValueError(f"config {config}: a gated product needs an even block_n (gate, up pairs)")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n // 2 if gated else n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    tiles = triton.cdiv(n, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    if config.split > 1:
        partials = torch.empty((config.split, m, n), dtype=torch.float32, device=x.device)
        counters = _COUNTERS.get(x.device, tiles)
    else:
        partials = counters = out  # unread
    pdl = pdl_enabled(x)
    _mma_kernel[(tiles, config.split)](
        x, weight, bias if bias is not None else out, out, partials, counters, m, n, k, x.stride(0), k_per_split,
        HAS_BIAS=bias is not None,
        GATED=gated,
        PDL=pdl,
        SPLIT=config.split,
        BLOCK_M=MAX_M,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out
