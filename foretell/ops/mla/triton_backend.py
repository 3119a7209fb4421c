"""The Triton MLA backend (graph safe): TritonMLABackend puts the latent cache writes
(triton_latent_write.py), the fused q and value sides (triton_fused.py) and the absorbed attention
(triton_attention.py) behind the MLA backend interface of TorchMLABackend (reference.py, its twin).
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.common.protocols import NormModule, RotaryModule
from foretell.ops.mla.reference import TorchMLABackend, projection_widths, split_kv_b
from foretell.ops.mla.triton_attention import mla_attention_triton
from foretell.ops.mla.triton_fused import absorb_query_triton, project_values_triton
from foretell.ops.mla.triton_latent_write import latent_write_triton, write_latent_triton


class TritonMLABackend:
    """The MLA backend interface of TorchMLABackend over the Triton kernels. Every query length
    goes through the absorbed kernel (prefill too), so nothing reads host lengths.

    `attend_projections` (what MLAAttention calls) runs the fused kernels of triton_latent_write.py
    and triton_fused.py around the attention: latent norm + k_pe RoPE + cache write in one launch,
    q_nope . W_UK and q_pe RoPE into one q_abs buffer in another, and the W_UV projection in a third."""

    graph_safe = True
    name = "triton"

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
        nope, rank, _ = projection_widths(q, kv_a, rotary_emb, kv_a_layernorm, kv_b_weight, kv_cache, v_head_dim)
        metadata.check_cache_block_size(kv_cache.shape[1], "MLA cache")
        num_tokens, num_heads, _ = q.shape
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope, v_head_dim)
        latent_write_triton(kv_a, positions, kv_a_layernorm, rotary_emb, kv_cache, metadata.slot_mapping, k_scale)
        q_abs = absorb_query_triton(q, w_uk, positions, rotary_emb,
                                    **self.absorb_launch(nope, rank, q.dtype))  # [T, heads, rank + rope]
        o_lat = torch.empty(num_tokens, num_heads, rank, dtype=q.dtype, device=q.device)
        mla_attention_triton(
            q_abs[..., :rank], q_abs[..., rank:], kv_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, metadata.max_query_len, scale, o_lat, k_scale=k_scale,
            **self.attention_launch(num_heads, kv_cache, q.dtype),
        )
        return project_values_triton(o_lat, w_uv, **self.project_launch(rank, v_head_dim, q.dtype))  # [T, heads, v]

    # The launch choices of attend_projections' three kernels: empty here (each kernel picks its
    # tiles, split count and RoPE placement from the step's shapes); the batch-invariant backend
    # fixes them (batch_invariant_triton.py).
    def absorb_launch(self, nope: int, rank: int, dtype: torch.dtype) -> dict:
        return {}

    def attention_launch(self, num_heads: int, kv_cache: torch.Tensor, dtype: torch.dtype) -> dict:
        return {}

    def project_launch(self, rank: int, v_head_dim: int, dtype: torch.dtype) -> dict:
        return {}

    def write_kv(
        self,
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank], normed
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim], rotated
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks padded rows
        k_scale: float = 1.0,
    ) -> None:
        write_latent_triton(latent, k_pe, kv_cache, slot_mapping, k_scale)

    def attend(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        metadata: AttentionMetadata,
        scale: float,
        v_head_dim: int,
        absorb: bool | None = None,  # False: the torch backend's expanded form (tests)
        k_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        if absorb is False:
            return TorchMLABackend().attend(
                q_nope, q_pe, kv_b_weight, kv_cache, metadata, scale, v_head_dim, absorb=False, k_scale=k_scale
            )
        metadata.check_cache_block_size(kv_cache.shape[1], "MLA cache")
        num_tokens, num_heads, nope = q_nope.shape
        rank = kv_cache.shape[-1] - q_pe.shape[-1]
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope, v_head_dim)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, heads, rank]
        o_lat = torch.empty(num_tokens, num_heads, rank, dtype=q_nope.dtype, device=q_nope.device)
        mla_attention_triton(
            q_lat, q_pe, kv_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, metadata.max_query_len, scale, o_lat, k_scale=k_scale,
        )
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)  # [T, heads, v]
