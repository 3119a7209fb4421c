"""FP8 KV cache storage: the cache dtype a `kv_cache_dtype` name means, and the torch twins of the
kernels' quantize-on-write and dequantize-on-read.

vLLM's semantics (its `kv_cache_dtype="fp8"`): the cache holds float8_e4m3fn (4 exponent bits,
3 mantissa bits, finite max 448, no infinities), one byte per element, so the same memory holds
twice the tokens of a bf16 cache. Each attention layer has a scale for its keys and one for its
values (MLA: one for its latent cache); a value x is stored as e4m3(clamp(x / scale, -448, 448))
and read back as e4m3 * scale. The scales come from the checkpoint (`k_scale` / `v_scale`, what
llm-compressor, ModelOpt and Quark write when they calibrate a KV cache) when it has them, else
1.0, as vLLM does.

What 1.0 means for accuracy: e4m3 keeps about 2 significant decimal digits (a relative rounding
error of up to 2^-4 = 6.25%, half that on average), is exact for the small magnitudes keys and
values usually take (normals from 2^-6 up to 448, subnormals down to 2^-9), and clamps at +-448.
Most models' keys and values sit well inside that range, so a scale of 1.0 costs only the
mantissa rounding; a model with outlier channels beyond 448 (or activations so small they fall
into the subnormals) needs calibrated scales. Attention itself never runs in FP8: the kernels
convert each tile to the query's dtype (exact: e4m3 fits bf16, fp16 and fp32) and fold the scales
into the scores (x k_scale) and the output (x v_scale), in float32.

Rounding: both sides multiply by the reciprocal of the scale in float32 (1 / 1.0 is exact) and
convert round-to-nearest-even with saturation, so the kernels and these twins store the same
bytes.
"""

from __future__ import annotations

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

# The accepted names (CacheConfig.kv_cache_dtype): "auto" stores the model dtype, the others e4m3.
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for a kv_cache_dtype name: the model's for auto, e4m3 for fp8."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_E4M3
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {name!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_E4M3


def check_scale(name: str, scale: float) -> float:
    """A KV scale as a float, refused when it is not finite and positive (a checkpoint's value)."""
    value = float(scale)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite positive number (the KV cache stores x / {name}), got {value}")
    return value


def quantize_for_cache(
    values: torch.Tensor,  # [..., width], any float dtype
    cache_dtype: torch.dtype,
    scale: float = 1.0,
) -> torch.Tensor:  # [..., width] in cache_dtype
    """What the cache stores for `values`: x / scale clamped to +-448 in e4m3 for an FP8 cache
    (the scale is ignored otherwise: the model dtype is stored as it is)."""
    if not is_fp8(cache_dtype):
        return values if values.dtype == cache_dtype else values.to(cache_dtype)
    scaled = values.float() * (1.0 / scale)
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_from_cache(
    stored: torch.Tensor,  # [..., width] in the cache dtype
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., width] in dtype
    """What an FP8 cache entry stands for (e4m3 * scale, in dtype); other caches as they are."""
    if not is_fp8(stored.dtype):
        return stored if stored.dtype == dtype else stored.to(dtype)
    values = stored.float()
    if scale != 1.0:
        values = values.mul_(scale)
    return values if dtype == torch.float32 else values.to(dtype)


def index_copy_slots(
    flat_cache: torch.Tensor,  # [num_slots, ...] a view of the cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    entries: torch.Tensor,  # [num_tokens, ...] in the cache dtype
) -> None:
    """flat_cache[slot_mapping] = entries. torch has no index_copy_ for float8 on the CPU: FP8
    caches are copied as their bytes."""
    if is_fp8(flat_cache.dtype):
        flat_cache, entries = flat_cache.view(torch.uint8), entries.view(torch.uint8)
    flat_cache.index_copy_(0, slot_mapping, entries)
