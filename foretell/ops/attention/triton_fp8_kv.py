"""The Triton side of the FP8 KV cache (fp8_kv.py holds the semantics and the torch twins): what a
kernel stores into a cache slot, and the compute dtype and dot precision of a cache's tiles.

A kernel stores `to_cache(x, inv_scale, cache_dtype)`: for an e4m3 cache x * (1 / scale) in
float32, clamped to +-448, rounded to nearest even (what quantize_for_cache does); for any other
cache x converted as before. Reads convert the e4m3 tile to the query's dtype (exact) and fold the
scales into the scores and the output, so no kernel multiplies a tile by its scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.fp8_kv import is_fp8


@triton.jit
def to_cache(x, inv_scale, cache_dtype: tl.constexpr):
    """x (any float dtype) as the cache stores it: scaled, clamped e4m3 for an FP8 cache."""
    if cache_dtype == tl.float8e4nv:
        scaled = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)  # FP8_E4M3_MAX (jit reads no globals)
        return _round_to_e4m3_grid(scaled).to(cache_dtype)
    return x.to(cache_dtype)


@triton.jit
def _round_to_e4m3_grid(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32, so the
    conversion after it is exact. A GPU's conversion rounds the same way by itself; Triton's
    interpreter rounds half up and loses the carry into the exponent (127.7 -> 64), so the kernels
    round first and store the same bytes everywhere. Adding then subtracting 1.5 * 2^23 ulp rounds
    at ulp, e4m3's spacing at |x|: 2^(exponent of x - 3), and 2^-9 (its subnormals) below 2^-6."""
    bits = x.to(tl.int32, bitcast=True)
    power = (bits & 0x7F800000).to(tl.float32, bitcast=True)  # 2^floor(log2|x|)
    ulp = tl.maximum(power * 0.125, 0.001953125)
    magic = ulp * 12582912.0
    rounded = (tl.abs(x) + magic) - magic
    # the sign put back by its bit, so -0.0 and values rounding to zero keep it (as torch's cast)
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


def compute_dtype(cache: torch.Tensor, query_dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention's tiles and dots run in: the query's for an FP8 cache (its tiles
    are converted on load), else the cache's own (as before FP8 caches existed)."""
    return query_dtype if is_fp8(cache.dtype) else cache.dtype


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for tiles of dtype: exact for float32, tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_fp8_query(cache: torch.Tensor, query_dtype: torch.dtype) -> None:
    """An FP8 cache's tiles are converted to the query's dtype: it must be a float type tl.dot takes."""
    if is_fp8(cache.dtype) and query_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"an FP8 KV cache is attended in the query's dtype, which must be bfloat16, "
                         f"float16 or float32; got {query_dtype}")
