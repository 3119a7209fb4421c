"""The Triton attention backend: the AttentionBackend protocol over the kernels in triton_paged.py and
triton_write_kv.py.

Same semantics as TorchAttentionBackend (its twin). Every launch reads only host ints that the
metadata already carries (max_query_len) and tensor shapes, so a step is CUDA-graph capturable
once each kernel shape has been compiled by a warm-up run. The split-K choice for decode depends
on shapes only (the block table's width, not max_seq_len), so eager and captured runs agree.
An FP8 cache (fp8_kv.py) is written and read with the layer's k_scale / v_scale, host floats fixed
after loading (a captured graph keeps them).
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.triton_paged import paged_attention_triton
from foretell.ops.attention.triton_write_kv import write_kv_triton
from foretell.ops.common.protocols import NormModule, RotaryModule
from foretell.ops.common.split_counters import SplitCounters


class TritonAttentionBackend:
    name = "triton"
    graph_safe = True
    fuses_rope = True
    fuses_tree_rope = True  # rope_attend honours metadata.tree_mask (a draft tree's rows)

    def __init__(self):
        self.split_counters = SplitCounters()  # shared by every layer: launches run in stream order

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks padded rows
        k_scale: float = 1.0,  # FP8 caches store key / k_scale
        v_scale: float = 1.0,
    ) -> None:
        write_kv_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def rope_attend(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        rotary_emb: RotaryModule,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], query's dtype or e4m3
        metadata: AttentionMetadata,
        scale: float,
        qk_norm: tuple[NormModule, NormModule] | None = None,  # (q_norm, k_norm), applied before RoPE
        k_scale: float = 1.0,  # FP8 caches
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """(q_norm / k_norm,) rotary_emb(positions, query, key), write_kv of the rotated key, then
        attend under metadata.tree_mask when it holds one: one launch for decode and short verify
        steps, tree verifies included (triton_rope_paged.fits), else RoPE + KV write in one and the
        attention in a second."""
        from foretell.ops.attention import triton_rope_paged
        from foretell.ops.attention.triton_rope_kv import rope_write_kv_triton

        metadata.check_cache_block_size(kv_cache.shape[2])
        if triton_rope_paged.fits(query, metadata.max_query_len, rotary_emb.rotary_dim, kv_cache):
            return triton_rope_paged.rope_paged_attention_triton(
                positions, query, key, value, rotary_emb.cos_cache, rotary_emb.sin_cache, kv_cache,
                metadata.slot_mapping, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
                metadata.max_query_len, scale, style=rotary_emb.style, qk_norm=qk_norm, counters=self.split_counters,
                k_scale=k_scale, v_scale=v_scale, tree_mask=metadata.tree_mask,
            )
        query = rope_write_kv_triton(positions, query, key, value, rotary_emb.cos_cache, rotary_emb.sin_cache,
                                     kv_cache, metadata.slot_mapping, style=rotary_emb.style, qk_norm=qk_norm,
                                     k_scale=k_scale, v_scale=v_scale)
        return self.attend(query, kv_cache, metadata, scale, k_scale, v_scale, tree_mask=metadata.tree_mask)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # FP8 caches: a stored key stands for key * k_scale
        v_scale: float = 1.0,
        tree_mask: torch.Tensor | None = None,  # [num_tokens, W]: a draft tree's rows over each sequence's last W keys (triton_paged.py)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        metadata.check_cache_block_size(kv_cache.shape[2])
        out = torch.empty_like(query)
        return paged_attention_triton(
            query,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            scale,
            out,
            counters=self.split_counters,
            k_scale=k_scale,
            v_scale=v_scale,
            tree_mask=tree_mask,
        )
