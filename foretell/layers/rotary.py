"""Rotary position embeddings: config parsing, the cos/sin cache, and applying it to q and k.

Three pieces, kept apart so a new variant touches one table:
  - `rope_parameters_from_config` reads theta and the scaling dict from a config, whichever way it
    spells them (transformers 4 `rope_scaling` + `rope_theta`, transformers 5 `rope_parameters`;
    the type under `rope_type` or the older `type`).
  - FREQUENCY_BUILDERS: rope type -> function(base, rotary_dim, params, max_positions) returning
    (inv_freq [rotary_dim // 2] float32, attention_factor). "yarn" (DeepSeek-V2/V3, Kimi) scales
    cos/sin by its attention factor; its softmax-scale correction is `yarn_softmax_scale_factor`.
  - APPLY_STYLES: style -> function(x, cos, sin). "neox" rotates halves (Llama, Qwen); "gptj"
    rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's complex-number RoPE). They are the
    RoPE op's torch twins and live with its kernels (ops/pointwise/reference.py).

Everything is computed in float32. The cos/sin table is built once, up front, for max_positions
positions, and kept as a plain tensor rather than a buffer so that casting the model's dtype can
never round it.

On CUDA (when ops/common/kernel_choice.use_triton allows) either style runs as one Triton kernel for q and
k together, reading the table by position, with the roundings of apply_rope_neox / apply_rope_gptj;
the torch code here is its twin and what the CPU runs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
from torch import nn

from foretell.ops.common import kernel_choice
from foretell.ops.pointwise.reference import APPLY_STYLES

FrequencyBuilder = Callable[[float, int, dict, int], tuple[torch.Tensor, float]]


def rope_parameters_from_config(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with a "rope_type" key) from an HFConfig.

    Accepts `rope_parameters` (transformers 5, may also hold rope_theta) or `rope_scaling`
    (transformers 4 and most published config.json files); null means no scaling.
    """
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(
            f"{config.source}: rope_scaling/rope_parameters must be an object or null, "
            f"got {params!r}"
        )
    params = dict(params)
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in FREQUENCY_BUILDERS:
        raise ValueError(
            f"{config.source}: rope type {rope_type!r} is not supported; supported types: "
            f"{', '.join(sorted(FREQUENCY_BUILDERS))}"
        )
    return float(theta), params


def base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:  # [rotary_dim // 2] float32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _require(params: dict, key: str) -> Any:
    if key not in params:
        raise ValueError(f"rope type {params['rope_type']!r} needs field {key!r} in rope_scaling")
    return params[key]


def default_frequencies(base, rotary_dim, params, max_positions):
    return base_inv_freq(base, rotary_dim), 1.0


def linear_frequencies(base, rotary_dim, params, max_positions):
    # Position interpolation: positions divided by factor, i.e. every frequency divided by it.
    return base_inv_freq(base, rotary_dim) / float(_require(params, "factor")), 1.0


def llama3_frequencies(base, rotary_dim, params, max_positions):
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(_require(params, "factor"))
    low_freq_factor = float(_require(params, "low_freq_factor"))
    high_freq_factor = float(_require(params, "high_freq_factor"))
    old_context = float(_require(params, "original_max_position_embeddings"))
    inv_freq = base_inv_freq(base, rotary_dim)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # 0 at the long-wavelength edge of the band (fully scaled), 1 at the short one (unscaled).
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled), 1.0


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not scaling up)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(base, rotary_dim, params, max_positions):
    """YaRN (arXiv 2309.00071) as DeepSeek-V2/V3 and Kimi use it.

    Dimensions rotating fewer than beta_slow times over the original context are interpolated
    (frequency / factor), those rotating more than beta_fast times are kept, with a linear ramp
    between. cos/sin are multiplied by the attention factor: explicit `attention_factor`, else
    m(mscale) / m(mscale_all_dim) when both are given (1.0 for DeepSeek-V3 and Kimi), else
    m(1) (transformers' reading, so the two agree on every published config).
    """
    original = float(_require(params, "original_max_position_embeddings"))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits num_rotations times into the original context.
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = base_inv_freq(base, rotary_dim)  # kept as trained
    interpolated = extrapolated / factor
    keep = 1 - ramp  # 1 for fast-rotating dims (kept), 0 for slow ones (interpolated)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def yarn_softmax_scale_factor(params: dict) -> float:
    """Multiplier of the attention softmax scale under YaRN in DeepSeek's MLA: m(mscale_all_dim)^2
    (1.0 without scaling or without mscale_all_dim). DeepSeek-V3 (factor 40): about 1.874."""
    if params.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = params.get("mscale_all_dim")
    if not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(float(_require(params, "factor")), float(mscale_all_dim))
    return m * m


FREQUENCY_BUILDERS: dict[str, FrequencyBuilder] = {
    "default": default_frequencies,
    "linear": linear_frequencies,
    "llama3": llama3_frequencies,
    "yarn": yarn_frequencies,
}


def build_cos_sin_cache(
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    num_positions: int,
    attention_factor: float = 1.0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_positions, rotary_dim // 2] float32
    positions = torch.arange(num_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq.to(device=device, dtype=torch.float32))
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope_neox_paired(
    x: torch.Tensor,  # [num_tokens, num_heads, rotary_dim]
    cos_pair: torch.Tensor,  # [num_tokens, 1, 2, rotary_dim // 2]: (cos, cos), x's dtype
    sin_pair: torch.Tensor,  # [num_tokens, 1, 2, rotary_dim // 2]: (-sin, sin), x's dtype
) -> torch.Tensor:  # [num_tokens, num_heads, rotary_dim]
    """apply_rope_neox from tables laid out per half: x * (cos, cos) + (x2, x1) * (-sin, sin).
    x2 * -sin is -(x2 * sin) exactly, so every product and sum rounds as there, bit for bit, in
    four launches instead of ten (what a CPU decode step pays for)."""
    num_tokens, num_heads, dim = x.shape
    halves = x.reshape(num_tokens, num_heads, 2, dim // 2)  # [T, H, 2, dim // 2]: (x1, x2)
    return (halves * cos_pair + halves.flip(2) * sin_pair).view(num_tokens, num_heads, dim)


class RotaryEmbedding(nn.Module):
    """Rotates the first rotary_dim channels of each q/k head by position.

    One instance is shared by every attention layer of a model.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        style: str = "neox",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        scaling = dict(scaling or {})
        rope_type = scaling.setdefault("rope_type", "default")
        if rope_type not in FREQUENCY_BUILDERS:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported types: "
                f"{', '.join(sorted(FREQUENCY_BUILDERS))}"
            )
        if style not in APPLY_STYLES:
            raise ValueError(f"rope style {style!r} is not one of {sorted(APPLY_STYLES)}")
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.rope_type = rope_type
        self.style = style
        self._rotate_fn = APPLY_STYLES[style]
        inv_freq, attention_factor = FREQUENCY_BUILDERS[rope_type](
            base, rotary_dim, scaling, max_positions
        )
        self.inv_freq = inv_freq  # [rotary_dim // 2] float32, kept for inspection and tests
        # [max_positions, rotary_dim // 2] each, float32
        self.cos_cache, self.sin_cache = build_cos_sin_cache(
            inv_freq, max_positions, attention_factor, device
        )

    def cos_sin(
        self, positions: torch.Tensor  # [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, rotary_dim // 2] float32 each
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fusable(positions, query, key):
            from foretell.ops.pointwise import triton_kernels  # imports triton: CUDA only

            return triton_kernels.rope_triton(
                positions, query, key, self.cos_cache, self.sin_cache, style=self.style
            )
        cos, sin = self.cos_sin(positions)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    @functools.cached_property
    def neox_pair_cache(self) -> torch.Tensor:  # [max_positions, 2, 1, 2, rotary_dim // 2] float32
        """Per position ((cos, cos), (-sin, sin)) for apply_rope_neox_paired, shaped so that a
        gather broadcasts over heads; built at first use (the torch path), so a GPU run that rotates
        in its kernels never holds it."""
        cos_pair = torch.stack((self.cos_cache, self.cos_cache), 1)  # [P, 2, rotary_dim // 2]
        sin_pair = torch.stack((-self.sin_cache, self.sin_cache), 1)
        return torch.stack((cos_pair, sin_pair), 1).unsqueeze(2)

    def rotate_heads(
        self, positions: torch.Tensor, x: torch.Tensor  # [num_tokens], [num_tokens, num_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """The torch path's rotation of any stack of heads (query and key heads side by side)."""
        if self.style == "neox" and self.rotary_dim == x.shape[-1]:
            pair = self.neox_pair_cache[positions]  # [T, 2, 1, 2, rotary_dim // 2]: one gather
            if pair.dtype != x.dtype:
                pair = pair.to(x.dtype)  # as apply_rope_neox rounds cos and sin to x's dtype
            return apply_rope_neox_paired(x, pair[:, 0], pair[:, 1])
        cos, sin = self.cos_sin(positions)
        return self._rotate(x, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return self._rotate_fn(x, cos, sin)
        rotated = self._rotate_fn(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)

    def fusable(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether the Triton kernels can rotate these (CUDA, one dtype, no autograd)."""
        return (
            query.dim() == 3
            and key.dim() == 3
            and query.dtype == key.dtype
            and self.cos_cache.device == query.device
            and kernel_choice.use_triton(positions, query, key)
        )

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, type={self.rope_type}, style={self.style}"
