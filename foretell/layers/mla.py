"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2): projections, the latent KV cache, and
its plain-torch attention.

Per token, kv_a_proj_with_mqa gives a latent c (kv_lora_rank) and ONE rope key k_pe
(qk_rope_head_dim) shared by every head; c is normed by kv_a_layernorm. The cache holds only
[c | rotated k_pe] per token per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
(576 values for DeepSeek-V3 and Kimi-K2, against 2 x heads x 192/128 for the keys and values it
stands for). kv_b_proj [heads * (nope + v), kv_lora_rank] expands c into per-head keys and values:
per head its first qk_nope_head_dim rows are W_UK, the next v_head_dim rows W_UV.

Two exact ways to attend over that cache (`TorchMLABackend`):
  expanded (prefill chunks): k = [c W_UK^T | k_pe], v = c W_UV^T for the whole context, then
    ordinary attention with 192-wide q/k. Cost grows with context x heads, once per chunk.
  absorbed (decode and verify, up to ABSORB_MAX_QUERY_LEN query rows): fold W_UK into the query,
    q_lat = q_nope W_UK (kv_lora_rank wide), and attend MQA-style with q = [q_lat | q_pe] against
    the cached [c | k_pe] as one key head; the output o_lat (kv_lora_rank wide) goes through W_UV.
    Nothing is expanded per context token, which is what makes MLA decode cheap.
The softmax scale is that of the 192-wide product in both: (nope + rope)^-0.5, times YaRN's
m(mscale_all_dim)^2 when scaled.

`MLA_BACKENDS` maps attention backend names to MLA backends: "triton" is TritonMLABackend
(mla_triton.py, imported only when asked for), which this torch backend is the reference for.
A backend's `attend_projections` takes the layer's raw projections (q per head, the kv_a slice of
fused_qkv_a_proj) and does everything between them and o_proj: kv_a_layernorm, RoPE, the cache
write, attention. Here that composes the modules' own ops; the Triton backend fuses them
(mla_fused_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foretell.layers.attention.metadata import AttentionMetadata
from foretell.layers.attention.torch_backend import causal_attention, gather_context
from foretell.layers.linear import Linear, MergedLinear
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding

# Longest query (per sequence) attended in the absorbed form; longer chunks expand the context.
ABSORB_MAX_QUERY_LEN = 16
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


def projection_widths(
    q: torch.Tensor,  # [num_tokens, num_heads, qk_nope + qk_rope]
    kv_a: torch.Tensor,  # [num_tokens, kv_lora_rank + qk_rope]
    rotary_emb: RotaryEmbedding,
    kv_a_layernorm: RMSNorm,
    kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope]
    v_head_dim: int,
) -> tuple[int, int, int]:
    """(qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) of an MLA layer's inputs, checked
    against each other; ValueError naming the tensor that does not fit."""
    rank, rope = kv_a_layernorm.hidden_size, rotary_emb.rotary_dim
    if q.dim() != 3 or q.shape[-1] <= rope:
        raise ValueError(f"q must be [num_tokens, num_heads, qk_nope + {rope}], got {list(q.shape)}")
    num_tokens, num_heads, qk_head_dim = q.shape
    nope = qk_head_dim - rope
    if kv_a.dim() != 2 or tuple(kv_a.shape) != (num_tokens, rank + rope):
        raise ValueError(f"kv_a must be [{num_tokens}, {rank + rope}] (kv_lora_rank + qk_rope_head_dim), "
                         f"got {list(kv_a.shape)}")
    if tuple(kv_b_weight.shape) != (num_heads * (nope + v_head_dim), rank):
        raise ValueError(f"kv_b_proj.weight must be [{num_heads * (nope + v_head_dim)}, {rank}] "
                         f"(heads * (qk_nope + v), kv_lora_rank), got {list(kv_b_weight.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != rank + rope:
        raise ValueError(f"the MLA cache must be [num_blocks, block_size, {rank + rope}], got "
                         f"{list(kv_cache.shape)}")
    return nope, rank, rope


class TorchMLABackend:
    graph_safe = False  # loops over the host copies of the lengths
    name = "torch"

    def attend_projections(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, qk_nope + qk_rope], may be a strided view
        kv_a: torch.Tensor,  # [num_tokens, kv_lora_rank + qk_rope], may be a strided view
        positions: torch.Tensor,  # [num_tokens]
        rotary_emb: RotaryEmbedding,
        kv_a_layernorm: RMSNorm,
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope]
        metadata: AttentionMetadata,
        scale: float,
        v_head_dim: int,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        """Norm the latent, rotate q_pe / k_pe, write the cache, attend: the reference path."""
        nope, rank, rope = projection_widths(q, kv_a, rotary_emb, kv_a_layernorm, kv_b_weight, kv_cache, v_head_dim)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = kv_a.split([rank, rope], dim=-1)
        latent, _ = kv_a_layernorm(latent)
        q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        self.write_kv(latent, k_pe.squeeze(1), kv_cache, metadata.slot_mapping)
        return self.attend(q_nope, q_pe, kv_b_weight, kv_cache, metadata, scale, v_head_dim)

    def write_kv(
        self,
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        entries = torch.cat([latent, k_pe], dim=-1).to(kv_cache.dtype)
        kv_cache.flatten(0, 1).index_copy_(0, slot_mapping, entries)

    def attend(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        metadata: AttentionMetadata,
        scale: float,
        v_head_dim: int,
        absorb: bool | None = None,  # None: by query length; True / False force a form (tests)
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        num_tokens, num_heads, nope = q_nope.shape
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope, v_head_dim)
        out = q_nope.new_empty(num_tokens, num_heads, v_head_dim)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            context = gather_context(kv_cache, metadata.block_table[i], seq_len)  # [S, rank+rope]
            use_absorbed = hi - lo <= ABSORB_MAX_QUERY_LEN if absorb is None else absorb
            if use_absorbed:
                out[lo:hi] = absorbed_attention(q_nope[lo:hi], q_pe[lo:hi], w_uk, w_uv, context, scale)
            else:
                out[lo:hi] = expanded_attention(q_nope[lo:hi], q_pe[lo:hi], w_uk, w_uv, context, scale)
        return out


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope: int, v_head_dim: int):
    """kv_b_proj's weight [heads * (nope + v), rank] -> views W_UK [heads, nope, rank] and
    W_UV [heads, v, rank]."""
    w = kv_b_weight.view(num_heads, nope + v_head_dim, kv_b_weight.shape[-1])
    return w[:, :nope], w[:, nope:]


def absorbed_attention(q_nope, q_pe, w_uk, w_uv, context, scale):
    """[q, heads, nope], [q, heads, rope], [heads, nope, rank], [heads, v, rank], [S, rank+rope]
    -> [q, heads, v]. The queries are the last q rows of the S-token context."""
    rank = w_uk.shape[-1]
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [q, heads, rank]
    query = torch.cat([q_lat, q_pe], dim=-1)  # [q, heads, rank + rope]
    key = context.unsqueeze(1).to(query.dtype)  # [S, 1, rank + rope]: one key head
    o_lat = causal_attention(query, key, key[..., :rank], scale)  # [q, heads, rank]
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)


def expanded_attention(q_nope, q_pe, w_uk, w_uv, context, scale):
    """Same contract as absorbed_attention, through per-head keys and values of the context."""
    rank = w_uk.shape[-1]
    latent, k_pe = context[:, :rank].to(q_nope.dtype), context[:, rank:].to(q_nope.dtype)
    k_nope = torch.einsum("sr,hdr->shd", latent, w_uk)  # [S, heads, nope]
    value = torch.einsum("sr,hvr->shv", latent, w_uv)  # [S, heads, v]
    key = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    return causal_attention(query, key, value, scale)


def _triton_mla_backend():
    # Imported only when asked for: it imports triton.
    from foretell.layers.mla_triton import TritonMLABackend

    return TritonMLABackend()


MLA_BACKENDS = {"torch": TorchMLABackend, "triton": _triton_mla_backend}


class LatentAttention(nn.Module):
    """The part of an MLA layer that owns the KV cache (what `attention_layers()` returns)."""

    def __init__(self, dims: MLADims, scale: float, backend_name: str = "torch"):
        super().__init__()
        self.num_heads = dims.num_heads
        self.kv_lora_rank = dims.kv_lora_rank
        self.qk_rope_head_dim = dims.qk_rope_head_dim
        self.v_head_dim = dims.v_head_dim
        self.scale = scale
        self.backend = MLA_BACKENDS.get(backend_name, TorchMLABackend)()
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

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
            self.scale, self.v_head_dim,
        )

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, cache_width={self.kv_lora_rank + self.qk_rope_head_dim}, "
                f"scale={self.scale:.5f}")


class MLAAttention(nn.Module):
    """`self_attn` of a DeepSeek layer; parameter names are the checkpoint's.

    `input_size` defaults to hidden_size (an EAGLE3 draft layer with MLA takes 2 x hidden).
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
    ):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        input_size = input_size or dims.hidden_size
        self.dims = dims
        q_out = dims.num_heads * dims.qk_head_dim
        # q_proj (or q_a_proj with a q LoRA) and kv_a_proj_with_mqa read the same input: one
        # matmul, shards 0 and 1 (at batch 1 the 576-row kv_a alone took as long as q_proj).
        self.q_size = dims.q_lora_rank or q_out
        self.fused_qkv_a_proj = MergedLinear(input_size, [self.q_size, dims.latent_dim], bias, **kw)
        if bias and not dims.q_lora_rank:  # HF's q_proj has no bias: that slice stays zero
            with torch.no_grad():
                self.fused_qkv_a_proj.bias[: self.q_size].zero_()
            self.fused_qkv_a_proj.bias.shard_ids = (1,)
        if dims.q_lora_rank:
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = Linear(dims.q_lora_rank, q_out, **kw)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = Linear(
            dims.kv_lora_rank, dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), **kw
        )
        self.o_proj = Linear(dims.num_heads * dims.v_head_dim, dims.hidden_size, bias, **kw)
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
