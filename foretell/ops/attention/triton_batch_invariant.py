"""Attention of the batch-invariant mode on CUDA (issue 23): the paged kernel of triton_paged.py with
its launch fixed, so that a query row's result depends on its own query and context only.

What makes the default launch batch-dependent, and what is fixed here:
  - the split count (flash-decoding) is chosen from the number of active programs, i.e. from the
    batch: here 1, always (a row's context is walked in one pass, tiles 0, 1, 2, ... in order);
  - the tile shape (query tokens per program, and with it the warps and the MMA shape) is chosen
    from the step's longest query: here sized for LAUNCH_QUERY_LEN whatever the step holds, so a
    decode, a verify of k + 1 and a prefill chunk run the same tiles.
A row then sees the same TILE_N-key tiles from position 0 in the same order in every formation:
tiles past its own position (present when it shares a program with later rows) are fully masked,
and an online-softmax step over a fully masked tile multiplies by exactly 1 and adds exactly 0.
Nothing reads host lengths: graph-safe, as TritonAttentionBackend.

RoPE (and Qwen3's q_norm / k_norm) and the KV write run as one launch before the attention,
triton_rope_kv.rope_write_kv_triton, for every step: a row's rotation is per (token, head block)
with a launch shape fixed by the head counts, so decode, verify and prefill rotate and store a
row alike. Without it (fuses_rope False) the layer ran the RoPE kernel and the KV write kernel,
two launches a layer more than the default path at batch 1, neither with programmatic dependent
launch (the chain of weight prefetches broke twice a layer). The default path's one-launch form
(triton_rope_paged.py) is not used: it scores with the rotary halves (another summation order than
the paged kernel's) and cannot take a prefill chunk, so a row would get other bits decoded than
prefilled.

tests/ops/test_batch_invariant_attention.py checks it in Triton's interpreter (float32 / float16
caches): a row computed alone, in chunks and among other sequences gives the same bits.
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.triton_paged import paged_attention_triton
from foretell.ops.attention.triton_rope_kv import rope_write_kv_triton
from foretell.ops.attention.triton_write_kv import write_kv_triton
from foretell.ops.common.protocols import NormModule, RotaryModule

# The query length every launch is sized for: a verify of k + 1 = 4 rows fills one program's tile,
# as a decode does with room to spare (any constant is invariant; this one favours decode/verify).
LAUNCH_QUERY_LEN = 4


class BatchInvariantTritonAttention:
    name = "triton_batch_invariant"  # ops/mla/dispatch.py gives its MLA layers the batch-invariant twin
    graph_safe = True
    fuses_rope = True  # rope_attend: RoPE + KV write in one launch, then the attention (the docstring)
    batch_invariant = True

    def write_kv(self, key, value, kv_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """(q_norm / k_norm,) RoPE and the KV write in one launch, then attend: the same two
        launches for a decode, a verify and a prefill chunk (the module docstring says why)."""
        metadata.check_cache_block_size(kv_cache.shape[2])
        query = rope_write_kv_triton(positions, query, key, value, rotary_emb.cos_cache, rotary_emb.sin_cache,
                                     kv_cache, metadata.slot_mapping, style=rotary_emb.style, qk_norm=qk_norm,
                                     k_scale=k_scale, v_scale=v_scale)  # rotated [num_tokens, num_heads, head_dim]
        return self.attend(query, kv_cache, metadata, scale, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        metadata.check_cache_block_size(kv_cache.shape[2])
        out = torch.empty_like(query)
        return paged_attention_triton(
            query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            metadata.max_query_len, scale, out, num_splits=1, k_scale=k_scale, v_scale=v_scale,
            launch_query_len=LAUNCH_QUERY_LEN,
        )
