"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2) as modules: the projections and the layer
that owns the latent KV cache.

Per token, kv_a_proj_with_mqa gives a latent c (kv_lora_rank) and ONE rope key k_pe
(qk_rope_head_dim) shared by every head; c is normed by kv_a_layernorm. The cache holds only
[c | rotated k_pe] per token per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
(576 values for DeepSeek-V3 and Kimi-K2, against 2 x heads x 192/128 for the keys and values it
stands for). The softmax scale is that of the 192-wide product: (nope + rope)^-0.5, times YaRN's
m(mscale_all_dim)^2 when scaled.

The attention over that cache is ops/mla: its torch reference (the expanded and absorbed forms,
ops/mla/reference.py), its Triton kernels, and build_mla_backend, which picks by the attention
backend's name. LatentAttention hands a backend the layer's raw projections (q per head, the kv_a
slice of fused_qkv_a_proj) and gets back the per-head output for o_proj.

FP8 latent cache (kv_cache_dtype="fp8"): LatentAttention's kv_scales.k_scale (1.0 unless the
checkpoint has self_attn.k_scale) scales the whole [c | k_pe] entry, as vLLM's MLA does; a
checkpoint's v_scale loads but is not used (c is the value as well as the key).

Tensor parallel (tp with several ranks): the heads are split. q_b_proj (or, without a q LoRA,
the q slice of fused_qkv_a_proj) and kv_b_proj are column-parallel (each head's rows are
contiguous, so an even row split is a head split), o_proj row-parallel with the sum over ranks;
q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so every rank writes the same latent
cache (it has no head axis) and attends with its own heads. The MLA kernels read the head count
from the tensors they get, so they run unchanged on this rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.attention.kv_scales import KVScales
from foretell.layers.linear import MergedLinear
from foretell.layers.parallel_linear import ColumnParallelLinear, row_parallel_linear
from foretell.layers.norm import RMSNorm
from foretell.layers.rank_slices import RankSlice, set_rank_slices
from foretell.layers.rotary import RotaryEmbedding
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.mla.dispatch import build_mla_backend

# DeepSeek's reference code and transformers build q_a_layernorm / kv_a_layernorm with the
# RMSNorm default eps, not the config's rms_norm_eps (Kimi-K2.5 has 1e-5 there).
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLADims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, config) -> "MLADims":
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:  # cached values per token per layer
        return self.kv_lora_rank + self.qk_rope_head_dim


class LatentAttention(nn.Module):
    """The part of an MLA layer that owns the KV cache (what `attention_layers()` returns)."""

    def __init__(self, dims: MLADims, scale: float, backend_name: str = "torch"):
        super().__init__()
        self.num_heads = dims.num_heads
        self.kv_lora_rank = dims.kv_lora_rank
        self.qk_rope_head_dim = dims.qk_rope_head_dim
        self.v_head_dim = dims.v_head_dim
        self.scale = scale
        self.backend = build_mla_backend(backend_name)
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales = KVScales()  # an FP8 cache's k_scale (the whole entry)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.kv_scales.freeze(kv_cache.dtype)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, qk_nope + qk_rope]
        kv_a: torch.Tensor,  # [num_tokens, kv_lora_rank + qk_rope]
        positions: torch.Tensor,  # [num_tokens]
        rotary_emb: RotaryEmbedding,
        kv_a_layernorm: RMSNorm,
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        if self.kv_cache is None:
            raise RuntimeError("MLA layer has no KV cache bound; the runner must bind one")
        return self.backend.attend_projections(
            q, kv_a, positions, rotary_emb, kv_a_layernorm, kv_b_weight, self.kv_cache, metadata,
            self.scale, self.v_head_dim, self.kv_scales.values[0],
        )

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, cache_width={self.kv_lora_rank + self.qk_rope_head_dim}, "
                f"scale={self.scale:.5f}")


class MLAAttention(nn.Module):
    """`self_attn` of a DeepSeek layer; parameter names are the checkpoint's.

    `input_size` defaults to hidden_size (an EAGLE3 draft layer with MLA takes 2 x hidden).
    `self.dims.num_heads` is this rank's head count under tp (`full_dims` the config's).
    """

    def __init__(
        self,
        dims: MLADims,
        rotary_emb: RotaryEmbedding,
        scale: float,
        backend_name: str = "torch",
        *,
        bias: bool = False,
        input_size: int | None = None,
        dtype=None,
        device=None,
        tp: TensorParallel | None = None,
        fp8_block: tuple[int, int] | None = None,  # FP8 projections (kv_b_proj stays float: the absorbed form reads it)
    ):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        fp8 = dict(kw, fp8_block=fp8_block)
        tp = tp or TensorParallel()
        input_size = input_size or dims.hidden_size
        self.full_dims = dims
        first_head, num_heads = tp.even_shard(dims.num_heads, "num_attention_heads")
        dims = replace(dims, num_heads=num_heads)  # this rank's heads
        self.dims = dims
        q_out = dims.num_heads * dims.qk_head_dim
        # q_proj (or q_a_proj with a q LoRA) and kv_a_proj_with_mqa read the same input: one
        # matmul, shards 0 and 1 (at batch 1 the 576-row kv_a alone took as long as q_proj).
        self.q_size = dims.q_lora_rank or q_out
        self.fused_qkv_a_proj = MergedLinear(input_size, [self.q_size, dims.latent_dim], bias, **fp8)
        if not dims.q_lora_rank:  # q_proj's rows of this rank's heads; kv_a whole
            q_slice = {0: RankSlice(0, first_head * dims.qk_head_dim, q_out, self.full_dims.num_heads * dims.qk_head_dim)}
            self.fused_qkv_a_proj.set_weight_rank_slices(q_slice, tp)
            set_rank_slices(self.fused_qkv_a_proj.bias, q_slice, tp)
        if bias and not dims.q_lora_rank:  # HF's q_proj has no bias: that slice stays zero
            with torch.no_grad():
                self.fused_qkv_a_proj.bias[: self.q_size].zero_()
            self.fused_qkv_a_proj.bias.shard_ids = (1,)
        if dims.q_lora_rank:
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, self.full_dims.num_heads * dims.qk_head_dim,
                                                 tp=tp, **fp8)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, **kw)
        kv_b_per_head = dims.qk_nope_head_dim + dims.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, self.full_dims.num_heads * kv_b_per_head, tp=tp, **kw)
        self.kv_b_proj.quantizable = False  # the attention backends read its float weight
        self.o_proj = row_parallel_linear(
            self.full_dims.num_heads * dims.v_head_dim, dims.hidden_size, bias, tp=tp, **fp8
        )
        self.rotary_emb = rotary_emb
        self.attn = LatentAttention(dims, scale, backend_name)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, input_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        d = self.dims
        num_tokens = hidden.shape[0]
        q, kv_a = self.fused_qkv_a_proj(hidden).split([self.q_size, d.latent_dim], dim=-1)
        if d.q_lora_rank:
            q_latent, _ = self.q_a_layernorm(q)
            q = self.q_b_proj(q_latent)
        q = q.view(num_tokens, d.num_heads, d.qk_head_dim)  # a strided view without a q LoRA
        out = self.attn(
            q, kv_a, positions, self.rotary_emb, self.kv_a_layernorm, self.kv_b_proj.weight, metadata
        )  # [num_tokens, num_heads, v_head_dim]
        return self.o_proj(out.reshape(num_tokens, d.num_heads * d.v_head_dim))
