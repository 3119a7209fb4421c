"""A GEMV for decode: y = x W^T (+ b) for x [M, K] with few rows (M <= 4), W [N, K].

At batch 1 (M = 1) or a verify of a few tokens at batch 1 a linear layer is bound by reading W
once, and a decode step is a chain of such reads with small kernels between them. The kernel is
built for that chain:
  - program p owns BLOCK_N consecutive rows of W (output columns) over all of K, read in
    [BLOCK_N, BLOCK_K] tiles; BLOCK_K is all of K up to 4096, so most layers read their whole slice
    in one request per program, and many programs (N / BLOCK_N, two rows each) keep HBM busy; a
    longer K (a down projection) takes four rows per program over 2048-wide tiles (pick_config);
  - programmatic dependent launch (ops/common/pdl.py): the program requests its first weight tile
    before it waits for the kernel before it, so the weights stream in while that kernel (a norm,
    the attention, the GEMV before) finishes; it lets the next kernel launch once its own reads are
    done. On the H200 a Llama-8B layer's four GEMVs, and the 32-layer chain with stand-in norms
    and attention, ran faster than cuBLAS (docs/perf-log.md);
  - `gated`: W is an MLP's [gate; up] and the kernel stores silu(gate) * up (with SiluAndMul's
    roundings): each program owns pairs of rows (gate j, up j), so the activation is its epilogue,
    and the down projection reads a plain input (a faster Llama-8B decode step on the H200 than
    with the activation applied by the down projection as it read gate_up); `float32_out` stores the
    rounded results as float32 (LMHead's logits: no cast launch);
  - up to MAX_M rows of x run one at a time against the same tile (its registers do not grow with
    M), but each row is another pass of float32 FMAs: slower than cuBLAS at M = 2 and 4 on the
    H200, so mode "on" uses this kernel for one row only (ops/gemm/triton_kernels.py; more rows go
    to the tensor-core ops/gemm/triton_mma.py);
  - float32 products summed per tile, over the K lanes of a tile then across tiles: a fixed order,
    the same result on every call (not cuBLAS's order: results differ from F.linear by float32
    rounding of the sums).

Output: x's dtype (or float32). Grids depend only on shapes, nothing syncs with the host, and the
output is a torch.empty of a shape fixed by (M, N), so a call can be captured in a CUDA graph.

Whether a layer uses this, the MMA or cuBLAS is decided by ops/gemm/dispatch.py; this module imports
triton and is imported only on CUDA (or by the interpreter tests, tests/ops/test_gemm_gemv.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import launch_options, let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel

MAX_M = 4
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_K = 4096  # a whole row of W per request up to this K; above it, tiles of LONG_K_BLOCK
LONG_K_BLOCK = 2048


@dataclass(frozen=True)
class SmallMConfig:
    block_m: int  # power of two >= M
    block_n: int  # rows of W per program
    block_k: int  # columns of W per tile
    num_warps: int

    def __str__(self) -> str:  # for logs and benchmark tables
        return f"BM{self.block_m} BN{self.block_n} BK{self.block_k} w{self.num_warps}"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pick_config(m: int, n: int, k: int, block_n: int | None = None, block_k: int | None = None) -> SmallMConfig:
    """Tiles for an [m, k] x [n, k]^T product, from the H200 at M = 1 (docs/perf-log.md, in
    the Llama-8B decode graph): up to K = 4096 two rows of W per program over all of K in one tile,
    eight warps; a longer K four rows over 2048-wide tiles, four warps (the down projection: faster
    than cuBLAS and than two rows; whole-K tiles of 8192-16384 were far slower)."""
    if not 1 <= m <= MAX_M or n < 1 or k < 1:
        raise ValueError(f"small-M GEMM needs 1 <= M <= {MAX_M}, N >= 1, K >= 1; got M={m}, N={n}, K={k}")
    block_m = _next_pow2(m)
    long_k = _next_pow2(k) > MAX_BLOCK_K
    if block_n is None:
        block_n = 4 if long_k else 2
    if block_k is None:
        block_k = LONG_K_BLOCK if long_k else _next_pow2(k)
    # Weights per thread per tile (BLOCK_N x BLOCK_K over the threads): 32, or 64 over a long K.
    num_warps = max(1, min(8, block_n * block_k // (32 * (64 if long_k else 32))))
    return SmallMConfig(block_m, block_n, block_k, num_warps)


def candidate_configs(m: int, n: int, k: int, device: torch.device) -> list[SmallMConfig]:
    """What the dispatch times against cuBLAS: the default tiles first, then 4 rows x 1024."""
    del device  # the tiles do not depend on the device's size: programs are many and small
    configs = [pick_config(m, n, k), pick_config(m, n, k, block_n=4, block_k=min(1024, _next_pow2(k)))]
    return list(dict.fromkeys(configs))


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 values with SiluAndMul's roundings in dtype (F.silu rounds, then
    the product does); float32 out."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype).to(tl.float32)


@triton.jit
def program_rows_of_w(program, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """(rows of W [BLOCK_N], which exist) for a program owning BLOCK_N output columns. GATED (W is
    [gate; up], N = 2I): BLOCK_N // 2 activations j, as interleaved pairs of rows (j, I + j), so
    one program holds both halves of each silu(gate) * up it writes."""
    lanes = tl.arange(0, BLOCK_N)
    if GATED:
        acts = program * (BLOCK_N // 2) + lanes // 2
        return tl.where(lanes % 2 == 0, acts, N // 2 + acts), acts < N // 2
    rows = program * BLOCK_N + lanes
    return rows, rows < N


@triton.jit
def _accumulate(acc, w, x_ptr, stride_xm, M, cols, K, BLOCK_M: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x[:, cols] . w^T for the weight tile w [BLOCK_N, BLOCK_K], the
    products summed over the tile's K lanes. One row: a [BLOCK_N, BLOCK_K] product; more rows: one
    [BLOCK_M, BLOCK_N, BLOCK_K] product, so the sum across the program's threads runs once a tile
    for every row together."""
    w = w.to(tl.float32)
    if BLOCK_M == 1:
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)  # [BLOCK_K]
        return acc + tl.sum(w * x[None, :], axis=1)[None, :]
    rows = tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & (cols < K)[None, :]  # padding rows (m >= M) read nothing
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return acc + tl.sum(w[None, :, :] * x[:, None, :], axis=2)  # [BLOCK_M, BLOCK_N]


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] (unread without HAS_BIAS)
    out_ptr,  # [M, N] contiguous ([M, N // 2] with GATED), x's dtype or float32
    M,
    N,
    K,
    stride_xm,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # W is [gate; up] (N = 2I rows): out [M, I] = silu(x gate^T) * (x up^T)
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols, col_ok = program_rows_of_w(tl.program_id(0), N, BLOCK_N, GATED)  # output columns = rows of W
    lanes = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K] at k = 0
    # W is streamed once per call: let it leave the cache first. No kernel of a step writes it, so
    # the first tile is requested before the wait for the kernel before this one.
    w = tl.load(w_tile, mask=col_ok[:, None] & (lanes < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _accumulate(acc, w, x_ptr, stride_xm, M, lanes, K, BLOCK_M)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & ((k0 + lanes) < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = _accumulate(acc, w, x_ptr, stride_xm, M, k0 + lanes, K, BLOCK_M)
    let_next_kernel_launch(PDL)  # this program's reads are done
    rows = tl.arange(0, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty  # results round to x's dtype (a float32 out holds them as they are)
    out_dtype = out_ptr.dtype.element_ty
    if GATED:  # columns hold (gate j, up j) pairs: one activation per pair
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
        acts = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + rows[:, None] * (N // 2) + acts[None, :]
        tl.store(out, silu_mul_rounded(gate, up, dtype).to(out_dtype),
                 mask=(rows < M)[:, None] & (acts < N // 2)[None, :])
    else:
        out = out_ptr + rows[:, None] * N + cols[None, :]
        tl.store(out, acc.to(dtype).to(out_dtype), mask=(rows < M)[:, None] & col_ok[None, :])


def check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: str = "small-M GEMM",  # how errors name the kernel
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
    max_m: int = MAX_M,
    gated: bool = False,
) -> None:
    """Raise a ValueError saying what is wrong unless the few-row kernel can run F.linear(x, weight,
    bias) (weight = [gate; up] of 2I rows when gated). Shared by triton_mma.py."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
    k = weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x must be [M, K={k}] for weight [N, K={k}], got {list(x.shape)}")
    if x.dtype not in dtypes or weight.dtype != x.dtype:
        raise ValueError(
            f"{kernel}: x and weight must share a dtype of {[str(d) for d in dtypes]}, got "
            f"{x.dtype} and {weight.dtype}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous (row-major [N, K]), got strides {weight.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(
            f"bias must be a contiguous [{weight.shape[0]}] {x.dtype} tensor, got "
            f"{list(bias.shape)} {bias.dtype}"
        )
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, weight and bias must be on one device, got {x.device} and {weight.device}")
    if not 1 <= x.shape[0] <= max_m or k < 1:
        raise ValueError(f"{kernel} takes 1 to {max_m} rows and K >= 1, got x {list(x.shape)}")


def small_m_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_M; any row stride
    weight: torch.Tensor,  # [N, K], x's dtype, contiguous
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: SmallMConfig | None = None,  # None: pick_config's choice
    gated: bool = False,  # weight is [gate; up]: return silu(gate) * up of F.linear's output
    float32_out: bool = False,  # the same values (rounded to x's dtype) in a float32 tensor
) -> torch.Tensor:  # [M, N] contiguous, x's dtype ([M, N // 2] when gated; float32 if asked)
    """F.linear(x, weight, bias) for few rows, reading weight exactly once."""
    check_inputs(x, weight, bias, gated=gated)
    m = x.shape[0]
    n, k = weight.shape
    if config is None:
        config = pick_config(m, n, k)
    if config.block_m < m:
        raise ValueError(f"config {config} has block_m {config.block_m} < M={m}")
    if gated and config.block_n % 2:
        raise ValueError(f"config {config}: a gated product needs an even block_n (gate, up pairs)")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n // 2 if gated else n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    pdl = pdl_enabled(x)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        PDL=pdl,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        **launch_options(pdl),
    )
    return out
