"""Plain-torch Multi-head Latent Attention over the latent cache: the reference the Triton kernels
(triton_attention.py, triton_fused.py, triton_latent_write.py) are held to, and what the CPU runs.

The cache holds [c | rotated k_pe] per token per layer: [num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]. kv_b_proj [heads * (nope + v), kv_lora_rank] expands c into per-head keys and
values: per head its first qk_nope_head_dim rows are W_UK, the next v_head_dim rows W_UV.

Two exact ways to attend over that cache (`TorchMLABackend`):
  expanded (prefill chunks): k = [c W_UK^T | k_pe], v = c W_UV^T for the whole context, then
    ordinary attention with 192-wide q/k. Cost grows with context x heads, once per chunk.
  absorbed (decode and verify, up to ABSORB_MAX_QUERY_LEN query rows): fold W_UK into the query,
    q_lat = q_nope W_UK (kv_lora_rank wide), and attend MQA-style with q = [q_lat | q_pe] against
    the cached [c | k_pe] as one key head; the output o_lat (kv_lora_rank wide) goes through W_UV.
    Nothing is expanded per context token, which is what makes MLA decode cheap.

A backend's `attend_projections` takes the layer's raw projections (q per head, the kv_a slice of
fused_qkv_a_proj) and does everything between them and o_proj: kv_a_layernorm, RoPE, the cache
write, attention. Here that composes the modules' own ops; the Triton backend fuses them.
The twins of the fused kernels follow: latent_write_torch, absorb_query_torch, project_values_torch.

An FP8 latent cache (ops/attention/fp8_kv.py) stores [c | k_pe] / k_scale in e4m3, one scale per
layer for the whole entry (c is both key and value: vLLM's MLA keeps a single scale too), and is
read back as e4m3 * k_scale in the query's dtype; other caches ignore k_scale.
"""

from __future__ import annotations

import torch

from foretell.ops.attention.fp8_kv import dequantize_from_cache, index_copy_slots, quantize_for_cache
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import causal_attention, gather_context, sequence_rows
from foretell.ops.common.protocols import NormModule, RotaryModule
from foretell.ops.pointwise.reference import APPLY_STYLES

# Longest query (per sequence) attended in the absorbed form; longer chunks expand the context.
ABSORB_MAX_QUERY_LEN = 16


def projection_widths(
    q: torch.Tensor,  # [num_tokens, num_heads, qk_nope + qk_rope]
    kv_a: torch.Tensor,  # [num_tokens, kv_lora_rank + qk_rope]
    rotary_emb: RotaryModule,
    kv_a_layernorm: NormModule,
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
        rotary_emb: RotaryModule,
        kv_a_layernorm: NormModule,
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope]
        metadata: AttentionMetadata,
        scale: float,
        v_head_dim: int,
        k_scale: float = 1.0,  # FP8 caches: stored entries are [c | k_pe] / k_scale
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        """Norm the latent, rotate q_pe / k_pe, write the cache, attend: the reference path."""
        nope, rank, rope = projection_widths(q, kv_a, rotary_emb, kv_a_layernorm, kv_b_weight, kv_cache, v_head_dim)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = kv_a.split([rank, rope], dim=-1)
        latent, _ = kv_a_layernorm(latent)
        q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        self.write_kv(latent, k_pe.squeeze(1), kv_cache, metadata.slot_mapping, k_scale)
        return self.attend(q_nope, q_pe, kv_b_weight, kv_cache, metadata, scale, v_head_dim, k_scale=k_scale)

    def write_kv(
        self,
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        k_scale: float = 1.0,  # FP8 caches store the entry / k_scale
    ) -> None:
        entries = quantize_for_cache(torch.cat([latent, k_pe], dim=-1), kv_cache.dtype, k_scale)
        index_copy_slots(kv_cache.flatten(0, 1), slot_mapping, entries)

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
        k_scale: float = 1.0,  # FP8 caches: an entry stands for stored * k_scale
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        num_tokens, num_heads, nope = q_nope.shape
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope, v_head_dim)
        out = q_nope.new_empty(num_tokens, num_heads, v_head_dim)
        for i, lo, hi, seq_len in sequence_rows(metadata):
            context = gather_latents(kv_cache, metadata.block_table[i], seq_len, k_scale, q_nope.dtype)
            use_absorbed = hi - lo <= ABSORB_MAX_QUERY_LEN if absorb is None else absorb
            if use_absorbed:
                out[lo:hi] = absorbed_attention(q_nope[lo:hi], q_pe[lo:hi], w_uk, w_uv, context, scale)
            else:
                out[lo:hi] = expanded_attention(q_nope[lo:hi], q_pe[lo:hi], w_uk, w_uv, context, scale)
        return out


def gather_latents(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    block_table_row: torch.Tensor,  # [max_blocks] int
    seq_len: int,
    k_scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [seq_len, kv_lora_rank + qk_rope_head_dim] dtype
    """A sequence's cache entries [c | k_pe] (an FP8 cache's dequantized with k_scale)."""
    return dequantize_from_cache(gather_context(kv_cache, block_table_row, seq_len), k_scale, dtype)


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


def latent_write_torch(kv_a, positions, kv_a_layernorm, rotary_emb, kv_cache, slot_mapping, k_scale=1.0) -> None:
    """Twin of latent_write_triton: the modules' own torch paths, then TorchMLABackend.write_kv
    (rows with slot < 0 dropped first, as the kernel skips them)."""
    rank = kv_a_layernorm.hidden_size
    keep = slot_mapping >= 0
    kv_a, positions, slot_mapping = kv_a[keep], positions[keep], slot_mapping[keep]
    latent, k_pe = kv_a[:, :rank], kv_a[:, rank:]
    latent, _ = kv_a_layernorm(latent)
    cos, sin = rotary_emb.cos_sin(positions)
    k_pe = APPLY_STYLES[rotary_emb.style](k_pe.unsqueeze(1), cos, sin).squeeze(1)
    TorchMLABackend().write_kv(latent, k_pe, kv_cache, slot_mapping, k_scale)


def absorb_query_torch(q, w_uk, positions, rotary_emb) -> torch.Tensor:
    """Twin of absorb_query_triton: TritonMLABackend's former einsum and RotaryEmbedding's rope."""
    nope = w_uk.shape[1]
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, heads, rank]
    cos, sin = rotary_emb.cos_sin(positions)
    return torch.cat([q_lat, APPLY_STYLES[rotary_emb.style](q_pe, cos, sin)], dim=-1)


# ---------------------------------------------------------------------- value projection


def project_values_torch(o_lat, w_uv) -> torch.Tensor:
    """Twin of project_values_triton (absorbed_attention's last einsum)."""
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)
