"""The batch-invariant mode's linear on CUDA (issue 23): y = x W^T (+ b) with one kernel for every M
and a reduction order set by the weight's shape (N, K) alone.

The default path runs a row through the GEMV at M = 1, the split-K MMA at 2..16 and cuBLAS above,
each summing K in its own order. Batch invariance does not need "no split-K": it needs each row's
order to be a function of that row's own sizes. So here:
  - `pick_shape_config(n, k, dtype, device)` fixes, per weight shape, the rows of W a program owns
    BLOCK_N (`block_n_for`: 64 for every shape today, a wgmma tile's M), the K step BLOCK_K and the
    split count SPLIT (triton_mma.py's decode choices: few tiles split K four ways, the o and down
    projections of Llama-8B; the rest run whole rows of K). It never sees M;
  - program (n tile, split s, m tile) owns BLOCK_N rows of W, the s-th slice of K and BLOCK_M
    rows of x; it walks its slice in BLOCK_K steps upwards, acc[BLOCK_N, BLOCK_M] = dot(W tile,
    x tile^T, acc) in float32 (the "swapped" MMA: W is the big operand, as in triton_mma.py);
  - BLOCK_N does not enter a row's K-sum order: each output element's sum is over the same BLOCK_K
    chunks in the same order whatever BLOCK_N is (a tile of W only decides which outputs a program
    writes). What BLOCK_N may change is the instruction that reduces one chunk: at 64 or 128 rows
    (4 warps) Triton emits wgmma m64nBLOCK_Mk16 on Hopper, at 16 or 32 rows (wgmma wants a multiple
    of 64) it falls back to mma.sync m16n8k16 (the same one at every BLOCK_M), and the two need not
    round a chunk alike (tests/ops/test_batch_invariant_block_n_sm90.py reads the sm_90 PTX). That
    is allowed because BLOCK_N is chosen per weight shape (N, K), never per M: for one weight every
    call, whatever its row count, reduces its chunks with the same kind of instruction, so rows stay
    invariant; another BLOCK_N for a shape may be another set of bits (as another BLOCK_K would be),
    which is why the in-graph sweep lists BLOCK_N candidates with the reordering ones;
  - with SPLIT > 1 each split stores a float32 partial and the split that arrives last at its
    tile's counter (acquire-release atomic) adds the partials in split order 0, 1, ..., so the sum
    does not depend on which finished first; it then applies the epilogue and zeroes the counter;
  - BLOCK_M (x rows per program) grows with M (row_tile: 16 up to 16 rows, then 64, then 128):
    an element's sum is over the same BLOCK_K chunks in the same order whatever BLOCK_M is, and a
    tensor-core dot with a fixed BLOCK_K, BLOCK_N and dtype reduces each chunk by the same instruction
    sequence (k16 steps into the accumulator) whatever its N side. tests/ops/
    test_batch_invariant_gemm.py checks rows across BLOCK_M in the interpreter, and tests/gpu/
    test_batch_invariant_gpu.py checks it bitwise on the device at M = 1..512. If a device ever
    disagreed, `fixed_block_m=16` (BatchInvariantGemm's field) runs one row tile for every M;
  - `gated` (W = [gate; up], N = 2I): each tile's rows are (gate j, up j) pairs (triton_gemv.
    program_rows_of_w) and the epilogue stores silu(gate) * up with SiluAndMul's roundings;
    `float32_out` (the LM head): the float32 sum stored as it is, not rounded to x's dtype first;
  - float32 inputs use IEEE products (no TF32) over a narrower K step (registers);
  - programmatic dependent launch (ops/common/pdl.py) as the decode kernels: the first weight tile is
    requested before waiting for the kernel before, so decode streams weights as the GEMV does.

Split partials are [SPLIT, rows, N] float32; long prefills run in launches of at most
MAX_SPLIT_ROWS rows (rows are independent, so where a launch starts changes no bits).
Grids depend only on shapes and nothing syncs with the host: a call can be captured in a graph once
the counters exist (the first eager call allocates them).
Twin: ops/gemm/batch_invariant.linear_batch_invariant_torch (same contract; another order, so
compared within rounding). The interpreter tests run float32 and float16 (its bf16 dot is broken).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel
from foretell.ops.common.split_counters import SplitCounters
from foretell.ops.gemm.triton_gemv import program_rows_of_w, silu_mul_rounded

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_BLOCK_N = 64  # rows of W per program (a wgmma tile's M): block_n_for's choice for every shape
NUM_WARPS = 4
MAX_SPLIT_ROWS = 1024  # rows per launch when K is split (bounds the partials: 4 x 1024 x N float32)
DEFAULT_SMS, DEFAULT_SMEM_BYTES = 132, 99 << 10  # when the device does not say (the interpreter)


@dataclass(frozen=True)
class ShapeConfig:
    """What fixes every row's reduction order for one weight shape (never chosen by M)."""

    block_k: int  # the K step
    split: int  # slices of K, summed in split order
    block_n: int = DEFAULT_BLOCK_N  # rows of W per program (may pick the chunk's MMA instruction)

    def __post_init__(self):
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"ShapeConfig.block_k must be a power of two of at least 16, got {self.block_k}")
        if self.split < 1:
            raise ValueError(f"ShapeConfig.split must be 1 or more, got {self.split}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"ShapeConfig.block_n must be a power of two of at least 16 (a tensor-core "
                             f"tile's rows), got {self.block_n}")

    def __str__(self) -> str:  # for logs and benchmark tables
        tile = "" if self.block_n == DEFAULT_BLOCK_N else f" BN{self.block_n}"
        return f"invariant BK{self.block_k} split{self.split}{tile}"


@functools.cache
def _device_limits(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 0) or DEFAULT_SMEM_BYTES


def device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, shared memory bytes a program may use)."""
    if device.type != "cuda":
        return DEFAULT_SMS, DEFAULT_SMEM_BYTES
    return _device_limits(device.index if device.index is not None else torch.cuda.current_device())


def block_n_for(n: int, k: int) -> int:
    """Rows of W per program for W [n, k]: a function of the weight's shape alone, never of M (the
    module docstring says why that keeps rows invariant). 64 for every shape until the in-graph
    sweep's BLOCK_N candidates (bench/kernels/linear_kinds.py) are measured on the device."""
    return DEFAULT_BLOCK_N


def pick_shape_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> ShapeConfig:
    """BLOCK_N, BLOCK_K and SPLIT for W [n, k] (BLOCK_N from block_n_for; the others
    shape_config_for_tile's rule, triton_mma.pick_config's choice at decode).
    Llama-3.1-8B in bf16 on the H200 (132 multiprocessors, 64-row tiles):
        qkv 6144 x 4096       96 tiles   split 1  BK 256  (fewer tiles than SMs: wide steps)
        o 4096 x 4096         64 tiles   split 4  BK 128  (at most half the SMs busy unsplit)
        gate_up 28672 x 4096  448 tiles  split 1  BK 128
        down 4096 x 14336     64 tiles   split 4  BK 128
        lm_head 128256 x 4096 2004 tiles split 1  BK 128
    float32 takes at most 32-wide steps (IEEE dots in registers)."""
    return shape_config_for_tile(n, k, dtype, device, block_n_for(n, k))


def shape_config_for_tile(n: int, k: int, dtype: torch.dtype, device: torch.device, block_n: int) -> ShapeConfig:
    """BLOCK_K and SPLIT for W [n, k] in tiles of block_n rows: split K four ways when the tiles
    fill at most half the multiprocessors, twice when fewer tiles than multiprocessors meet a long
    K; wide K steps (256) for unsplit rows with fewer tiles than multiprocessors."""
    if n < 1 or k < 1:
        raise ValueError(f"batch-invariant linear needs N >= 1 and K >= 1, got N={n}, K={k}")
    sms, _ = device_limits(device)
    tiles = triton.cdiv(n, block_n)
    if 2 * tiles <= sms and k >= 4 * 128:
        split = 4
    else:
        split = 2 if tiles < sms and k >= 8192 else 1
    block_k = 256 if split == 1 and tiles < sms else 128
    if dtype == torch.float32:
        block_k = 32
    return ShapeConfig(min(block_k, max(16, triton.next_power_of_2(k))), split, block_n)


def row_tile(m: int, block_k: int, fixed_block_m: int | None = None) -> int:
    """x rows per program for an M-row call: 16 for decode and verify, larger tiles for more rows
    (fewer reads of W from L2). Never changes a row's sums (the module docstring says why)."""
    if fixed_block_m is not None:
        return fixed_block_m
    if m <= 16:
        return 16
    return 64 if m <= 64 or block_k > 128 else 128


def _stages_that_fit(block_n: int, block_m: int, block_k: int, itemsize: int, smem_bytes: int,
                     wanted: int = 4) -> int:
    """Pipeline depth whose shared memory fits (Triton keeps num_stages + 1 tiles of W and x^T)."""
    per_stage = (block_n + block_m) * block_k * itemsize
    return max(1, min(wanted, smem_bytes // per_stage - 1))


@triton.jit
def _batch_invariant_linear_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] contiguous
    b_ptr,  # [N] (unread without HAS_BIAS)
    y_ptr,  # [M, N_OUT] contiguous (N_OUT = N // 2 when GATED)
    partial_ptr,  # [SPLIT, M, N] float32 (unused when SPLIT == 1)
    counter_ptr,  # [>= n tiles * m tiles] int32, zero (unused when SPLIT == 1)
    M, N, K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K, a function of (N, K) only
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, FLOAT32_OUT: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), else the dtype's tensor-core dot
    W_EVICTION: tl.constexpr,  # a cache hint only: "evict_first" when one row tile reads W
    PDL: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # m tiles fastest: the programs of one W tile run side by side and share it through L2.
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    cols, col_ok = program_rows_of_w(tile, N, BLOCK_N, GATED)  # rows of W
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x
    row_ok = rows < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    lanes = k_start + tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + rows[None, :].to(tl.int64) * stride_xm + lanes[:, None]  # [BLOCK_K, BLOCK_M]
    # No kernel of a step writes W: its first tile is requested before the wait (ops/common/pdl.py).
    w = tl.load(w_tile, mask=col_ok[:, None] & (lanes < k_end)[None, :], other=0.0, eviction_policy=W_EVICTION)
    wait_for_previous_kernel(PDL)
    xt = tl.load(x_tile, mask=(lanes < k_end)[:, None] & row_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M] float32
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):  # the same steps, in the same order, for every M
        k_ok = (lanes + k0) < k_end
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy=W_EVICTION)
        xt = tl.load(x_tile + k0, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    let_next_kernel_launch(PDL)  # this program's reads of W are done

    out_mask = col_ok[:, None] & row_ok[None, :]
    if SPLIT > 1:
        offsets = rows[None, :].to(tl.int64) * N + tile * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tl.store(partial_ptr + split * M * N + offsets, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = counter_ptr + pid_m * tl.num_programs(1) + tile
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last split of this tile: every partial is visible now
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(SPLIT):  # split order: the same sum whichever split finished last
                acc += tl.load(partial_ptr + s * M * N + offsets, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_rows(acc, b_ptr, y_ptr, cols, col_ok, rows, row_ok, tile, N,
                        HAS_BIAS, GATED, FLOAT32_OUT, BLOCK_N, BLOCK_M, x_ptr.dtype.element_ty)
            tl.atomic_xchg(counter, 0)  # ready for the next launch
    else:
        _store_rows(acc, b_ptr, y_ptr, cols, col_ok, rows, row_ok, tile, N,
                    HAS_BIAS, GATED, FLOAT32_OUT, BLOCK_N, BLOCK_M, x_ptr.dtype.element_ty)


@triton.jit
def _store_rows(acc, b_ptr, y_ptr, cols, col_ok, rows, row_ok, tile, N,
                HAS_BIAS: tl.constexpr, GATED: tl.constexpr, FLOAT32_OUT: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, dtype: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (rows of W x rows of x) (+ bias) -> y[rows, cols]: rounded to dtype,
    or the float32 sum as it is (FLOAT32_OUT); GATED: (gate j, up j) pairs -> silu(gate) * up."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    if GATED:
        pairs = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_N // 2, 2, BLOCK_M]), (0, 2, 1))
        gate, up = tl.split(pairs)  # [BLOCK_N // 2, BLOCK_M] each
        acts = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = silu_mul_rounded(gate, up, dtype)
        ptrs = y_ptr + rows[None, :].to(tl.int64) * (N // 2) + acts[:, None]
        mask = (acts < N // 2)[:, None] & row_ok[None, :]
    else:
        out = acc
        ptrs = y_ptr + rows[None, :].to(tl.int64) * N + cols[:, None]
        mask = col_ok[:, None] & row_ok[None, :]
    if FLOAT32_OUT:
        tl.store(ptrs, out, mask=mask)
    else:
        tl.store(ptrs, out.to(dtype), mask=mask)


def linear_batch_invariant_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,
    float32_out: bool = False,
    counters: SplitCounters | None = None,  # the caller's persistent counters; None: zeros per call
    fixed_block_m: int | None = None,  # one row tile for every M (None: row_tile's choice)
    config: ShapeConfig | None = None,  # None: pick_shape_config's (what the mode runs)
    num_stages: int | None = None,  # pipeline depth (a launch choice: no bits change); None: what fits
) -> torch.Tensor:  # [M, N] (gated: [M, N // 2]); float32 with float32_out, else x's dtype
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K] with the same K, got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"batch-invariant linear: x and weight must share a dtype of "
                         f"{[str(d) for d in SUPPORTED_DTYPES]}, got {x.dtype} and {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] tensor of {x.dtype}, got "
                         f"{list(bias.shape)} {bias.dtype}")
    if fixed_block_m is not None and fixed_block_m not in (16, 32, 64, 128):
        raise ValueError(f"fixed_block_m must be 16, 32, 64 or 128 (or None), got {fixed_block_m}")
    if num_stages is not None and not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages must be 1 to 8 (or None), got {num_stages}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    y = torch.empty(m, n_out, dtype=torch.float32 if float32_out else x.dtype, device=x.device)  # [M, N_OUT]
    if m == 0 or n_out == 0:
        return y
    config = config or pick_shape_config(n, k, x.dtype, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    _, smem = device_limits(x.device)
    pdl = pdl_enabled(x)
    tiles = triton.cdiv(n, config.block_n)
    step = MAX_SPLIT_ROWS if config.split > 1 else m
    for lo in range(0, m, step):  # rows are independent: where a launch starts changes no bits
        rows = min(step, m - lo)
        block_m = row_tile(rows, config.block_k, fixed_block_m)
        m_tiles = triton.cdiv(rows, block_m)
        if config.split > 1:
            partials = torch.empty((config.split, rows, n), dtype=torch.float32, device=x.device)
            count = m_tiles * tiles
            counter_buf = (counters.get(x.device, count) if counters is not None
                           else torch.zeros(count, dtype=torch.int32, device=x.device))
        else:
            partials = counter_buf = y  # unread
        _batch_invariant_linear_kernel[(m_tiles, tiles, config.split)](
            x[lo:], weight, bias if bias is not None else weight, y[lo:], partials, counter_buf,
            rows, n, k, x.stride(0), k_per_split,
            HAS_BIAS=bias is not None, GATED=gated, FLOAT32_OUT=float32_out,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # (tf32 is ignored by fp16 / bf16 dots)
            W_EVICTION="evict_first" if m_tiles == 1 else "",
            PDL=pdl, SPLIT=config.split, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=NUM_WARPS,
            num_stages=num_stages or _stages_that_fit(config.block_n, block_m, config.block_k, x.element_size(), smem),
            **launch_options(pdl),
        )
    return y
