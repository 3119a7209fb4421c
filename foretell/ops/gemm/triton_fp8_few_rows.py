"""FP8-weight linears for a few rows: y = x (q * s)^T (+ b) for x [M, K] (1 <= M <= 16) and an FP8
weight q [N, K] with its float32 scales s, per 128x128 block (DeepSeek-V3 / Kimi-K2 checkpoints) or
per output channel (`quantization="fp8"`); layouts in fp8_reference.py, which holds the twin
(fp8_linear_torch).

Decode, verify and draft steps read every weight once for a handful of rows, so they are bound by
the weight bytes: these kernels read the weight in its 8 bits and scale it in-kernel, with no
activation quantization (the result is the dequantized weight's product, as the CPU path computes
it): the GEMV and the MMA sum in float32, the half GEMV in fp16 pairs per lane.

  HALF GEMV (one row of fp16 / bf16 x, Fp8HalfGemvConfig: decode at batch 1, the default there):
    products summed in fp16 pairs, x brought into fp16's range by a power of two
    (triton_fp8_gemv_half.py, which says why and what it costs in accuracy).
  GEMV (up to 4 rows, Fp8GemvConfig: float32 x, and one row of fp16 / bf16 x where the half GEMV's
    tile would straddle a scale block; the kernel in triton_fp8_gemv.py, which says how): program
    (p, s) owns BLOCK_N rows of W over the s-th of SPLIT slices of K and sums w * (x s) in float32,
    x's columns scaled by their block's scale (per-channel scales: each row's sum, in the epilogue).
  MMA (up to 16 rows, fp16 / bf16 x, Fp8MmaConfig; the kernel in triton_fp8_mma.py): program (p, s)
    owns 64 rows of W (one wgmma tile) and the s-th slice of K, and multiplies [64, BLOCK_K] weight
    tiles, converted in registers (exact: every e4m3 value is a bf16 and an fp16 value), by x^T
    tiles [BLOCK_K, 16] on tensor cores; with BLOCK_K dividing the quant block's width, each tile's
    float32 product is scaled by one scale per row of W before it is added. The dot runs in fp16
    (`half_x`, the default): sm_90 turns an e4m3 pair into an f16 pair in one instruction but
    reaches bf16 only through float32, so each row of x is first multiplied by a power of two that
    puts its largest |x| over the slice in [2^13, 2^14) (triton_fp8_gemv_half.row_shifts; a pass
    over x before the loop) and becomes fp16 exactly (a bf16 value's 8 significant bits fit fp16's
    11 down to 2^-27 of the row's largest); the float32 sums are divided by it after the loop.
    half_x=False dots in x's own dtype.

Split-K (both kernels, `split` > 1: layers with fewer programs than the device has
multiprocessors, Llama-8B's o and down projections at M > 1): each split stores a float32 partial;
the split arriving last at its tile's counter (acquire-release) sums the partials in split order
(the same result whichever finished first), applies the epilogue and zeroes the counter, as
ops/gemm/triton_mma.py does. `gated` (W = [gate; up] of an MLP): programs own (gate j, up j) row
pairs and store silu(gate) * up with SiluAndMul's roundings (no gate_up tensor, no launch).

Both request their first weight tile before waiting for the kernel before them and let the next
kernel launch once their reads are done (programmatic dependent launch, ops/common/pdl.py). Grids
depend only on shapes, partials are a torch.empty and the counters are allocated at the first
(eager) launch, so calls can be captured in CUDA graphs. gemv_config / mma_config are the defaults;
candidate_configs lists what scripts/sweep_linears_in_graph_gpu.py --families fp8 times on the H200.

This module imports triton: only ops/gemm/fp8_dispatch.py imports it, on CUDA (and the
interpreter tests, tests/ops/test_gemm_fp8.py).
"""

from __future__ import annotations

import torch
import triton

from foretell.ops.common.pdl import launch_options, pdl_enabled
from foretell.ops.common.split_counters import SplitCounters
from foretell.ops.gemm.fp8_reference import check_fp8_weight
from foretell.ops.gemm.triton_fp8_gemv import (GEMV_CANDIDATES, GEMV_MAX_M, Fp8GemvConfig, _fp8_gemv_kernel,
                                               _next_pow2, gemv_config)
from foretell.ops.gemm.triton_fp8_gemv_half import (HALF_GEMV_CANDIDATES, HALF_X_DTYPES, Fp8HalfGemvConfig,
                                                    half_gemv_config, launch_fp8_gemv_half)
from foretell.ops.gemm.triton_fp8_mma import MAX_M, MMA_BLOCK_N, Fp8MmaConfig, _fp8_mma_kernel, _mma_stages, mma_config
from foretell.ops.gemm.triton_mma import device_limits

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MMA_X_DTYPES = (torch.bfloat16, torch.float16)
# A counter per program tile, zero between launches (one set per process, as triton_mma.py's).
_COUNTERS = SplitCounters(min_count=1 << 16)


def kernel_block_ok(block_size: tuple[int, int] | None) -> bool:
    """The kernels take per-channel scales, or blocks whose width is a power of two (every
    published checkpoint: 128 x 128); other widths go to the torch twin."""
    return block_size is None or (block_size[1] & (block_size[1] - 1)) == 0


def default_config(m: int, n: int, k: int, dtype: torch.dtype, block_size: tuple[int, int] | None,
                   device: torch.device | None = None):
    """The half-precision GEMV for one row of fp16 / bf16 (triton_fp8_gemv_half.py), the float32
    GEMV for a float32 x, the MMA for more rows of fp16 / bf16. The GEMVs' rows of W per program stay
    within one block row (the float32 GEMV's four when eight would not fit the blocks)."""
    if m == 1 and dtype in HALF_X_DTYPES:
        config = half_gemv_config(n, k)
        if gemv_rows_fit_blocks(config.block_n, n, block_size, gated=False):
            return config
    if m == 1 or dtype not in MMA_X_DTYPES:
        config = gemv_config(m, n, k, device=device)
        if not gemv_rows_fit_blocks(config.block_n, n, block_size, gated=False):
            config = gemv_config(m, n, k, block_n=4, device=device)
        return config
    return mma_config(k, block_size, n, device)


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype, block_size: tuple[int, int] | None,
                      device: torch.device | None = None) -> list:
    """default_config first, then the GEMV tiles, warps and splits (columns per tile shrinking as
    rows of x grow) and the MMA tile widths and splits that the H200 sweep times for this shape.
    The MMA is a candidate at one row of fp16 / bf16 x too (15 of its 16 rows padding): on tensor
    cores a weight costs its conversion and a sixteenth of an MMA, not a float32 FMA, and its tiles
    stream through shared memory several in flight (cp.async stages). Its sm_90 loop at Llama's
    qkv takes 3.4 instructions a weight for fp16 x at 128 columns (2.7 at 256, per channel) and
    4.9 for bf16 x (the weight made bf16 through float32), the GEMV 3.15-3.6."""
    configs = [default_config(m, n, k, dtype, block_size, device)]
    if m == 1 and dtype in HALF_X_DTYPES:
        for block_n, block_k, warps, split in HALF_GEMV_CANDIDATES:
            if block_k <= 2 * _next_pow2(k) and (split == 1 or k // split >= block_k):
                configs.append(half_gemv_config(n, k, block_n, block_k, warps, split))
    if m <= GEMV_MAX_M:
        for block_n, block_k, warps, split in GEMV_CANDIDATES:
            block_k //= _next_pow2(m)
            if block_k <= 2 * _next_pow2(k) and (split == 1 or k // split >= block_k):
                configs.append(gemv_config(m, n, k, block_k, block_n, warps, split))
    if dtype in MMA_X_DTYPES:
        _, smem = device_limits(device or torch.device("cpu"))
        for block_k in (64, 128, 256):
            if block_size is not None and block_size[1] % block_k:
                continue
            for split in (1, 2, 4, 8):
                if k // split >= max(block_k, 256):
                    configs.append(Fp8MmaConfig(block_k, _mma_stages(MMA_BLOCK_N, block_k, smem), split=split))
    return list(dict.fromkeys(configs))


def check_few_rows_inputs(x, weight, weight_scale, block_size, bias, max_m: int, dtypes, gated: bool = False) -> None:
    """Raise a ValueError naming what is wrong unless the few-row kernels can take these."""
    check_fp8_weight(weight, weight_scale, block_size)
    if not kernel_block_ok(block_size):
        raise ValueError(f"the FP8 kernels take blocks of a power-of-two width, got block_size {block_size}")
    n, k = weight.shape
    if gated and n % 2:
        raise ValueError(f"a gated weight is [gate; up] with an even number of rows, got {list(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K={k}] for an FP8 weight {list(weight.shape)}, got {list(x.shape)}")
    if not 1 <= x.shape[0] <= max_m:
        raise ValueError(f"this FP8 kernel takes 1 to {max_m} rows, got x {list(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"this FP8 kernel takes x in {[str(d) for d in dtypes]}, got {x.dtype}")
    if not weight.is_contiguous() or not weight_scale.is_contiguous():
        raise ValueError("an FP8 weight and its scale must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] {x.dtype} tensor, got {list(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (x, weight, weight_scale) + (() if bias is None else (bias,))}
    if len(devices) != 1:
        raise ValueError(f"x, weight, weight_scale and bias must be on one device, got {sorted(map(str, devices))}")


def gemv_rows_fit_blocks(block_n: int, n: int, block_size: tuple[int, int] | None, gated: bool) -> bool:
    """Whether every GEMV program's rows of W lie in one block row (gate rows in one and up rows
    in one when gated), which its scaling of x by column block needs."""
    if block_size is None:
        return True
    rows_per_part = block_n // 2 if gated else block_n
    return block_size[0] % rows_per_part == 0 and (not gated or (n // 2) % rows_per_part == 0)


def fp8_few_rows_linear(
    x: torch.Tensor,  # [M, K], 1 <= M <= 16; any row stride
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous ([gate; up] when gated)
    weight_scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] or [N, 1] float32, contiguous
    block_size: tuple[int, int] | None,  # None: per-channel scales
    bias: torch.Tensor | None = None,  # [N], x's dtype
    config: Fp8GemvConfig | Fp8MmaConfig | None = None,  # None: default_config's choice
    float32_out: bool = False,  # the values rounded to x's dtype, stored as float32
    gated: bool = False,  # silu(gate) * up of the product (SiluAndMul's roundings), [M, N // 2]
) -> torch.Tensor:  # [M, N] contiguous ([M, N // 2] when gated), x's dtype (or float32)
    """fp8_linear_torch(x, weight, weight_scale, block_size, bias) reading the FP8 weight once."""
    m = x.shape[0] if x.dim() == 2 else 0
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if config is None and 1 <= m <= MAX_M:
        config = default_config(m, n, k, x.dtype, block_size, x.device)
    if isinstance(config, Fp8HalfGemvConfig):
        return _half_gemv_linear(x, weight, weight_scale, block_size, bias, config, float32_out, gated)
    mma = isinstance(config, Fp8MmaConfig)
    check_few_rows_inputs(x, weight, weight_scale, block_size, bias, MAX_M if mma else GEMV_MAX_M,
                          MMA_X_DTYPES if mma else X_DTYPES, gated)
    qblock_n, qblock_k = block_size if block_size is not None else (1, 1)
    if mma and block_size is not None and qblock_k % config.block_k:
        raise ValueError(f"config {config}: block_k must divide the quant block's width {qblock_k}")
    if not mma and config.block_m < m:
        raise ValueError(f"config {config} has block_m {config.block_m} < M={m}")
    if gated and config.block_n % 2:
        raise ValueError(f"config {config}: a gated product needs an even block_n (gate, up pairs)")
    if not mma and not gemv_rows_fit_blocks(config.block_n, n, block_size, gated):
        raise ValueError(f"config {config}: a program's rows of W must lie in one block row of {block_size}"
                         f"{' (gate and up rows each)' if gated else ''}")
    if config.split < 1:
        raise ValueError(f"config {config}: split must be >= 1")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n // 2 if gated else n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    tiles = triton.cdiv(n, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = _COUNTERS.get(x.device, tiles)
    else:
        partials = counters = out  # unread
    pdl = pdl_enabled(x)
    args = (x, weight, weight_scale, bias if bias is not None else out, out, partials, counters, m, n, k, x.stride(0),
            weight_scale.stride(0), k_per_split)
    common = dict(QBLOCK_N=qblock_n, QBLOCK_K=qblock_k, PER_CHANNEL=block_size is None, HAS_BIAS=bias is not None,
                  GATED=gated, PDL=pdl, SPLIT=split, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  num_warps=config.num_warps, **launch_options(pdl))
    if mma:
        _fp8_mma_kernel[(tiles, split)](*args, BLOCK_M=MAX_M, num_stages=config.num_stages,
                                        HALF_X=config.half_x, **common)
    else:
        _fp8_gemv_kernel[(tiles, split)](*args, BLOCK_M=config.block_m, **common)
    return out


def _half_gemv_linear(x, weight, weight_scale, block_size, bias, config: Fp8HalfGemvConfig, float32_out: bool,
                      gated: bool) -> torch.Tensor:
    """fp8_few_rows_linear on the half-precision GEMV (one row of fp16 / bf16 x)."""
    check_few_rows_inputs(x, weight, weight_scale, block_size, bias, 1, HALF_X_DTYPES, gated)
    n = weight.shape[0]
    if gated and config.block_n % 2:
        raise ValueError(f"config {config}: a gated product needs an even block_n (gate, up pairs)")
    if not gemv_rows_fit_blocks(config.block_n, n, block_size, gated):
        raise ValueError(f"config {config}: a program's rows of W must lie in one block row of {block_size}"
                         f"{' (gate and up rows each)' if gated else ''}")
    if config.split < 1:
        raise ValueError(f"config {config}: split must be >= 1")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((1, n // 2 if gated else n), dtype=torch.float32 if float32_out else x.dtype, device=x.device)
    launch_fp8_gemv_half(x, weight, weight_scale, block_size, bias, out, config, gated, _COUNTERS)
    return out
