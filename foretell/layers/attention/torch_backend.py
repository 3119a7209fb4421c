"""Plain-torch attention over the paged cache: the reference every kernel is held to.

Runs on any device. Loops over sequences on the host (the metadata carries host copies of the
lengths, so there is no device sync); each sequence gathers its context from its block table and
attends with a causal mask offset by its cached prefix. Scores and softmax are computed in float32.
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    flat = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim] (a view)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, ...]
    block_table_row: torch.Tensor,  # [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, ...]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table_row[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


def causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, v_head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, v_head_dim]
    """Queries are the last q_len positions of a seq_len context."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.float().view(q_len, num_kv_heads, group, -1).permute(1, 2, 0, 3)
    k = key.float().permute(1, 0, 2)  # [num_kv_heads, seq_len, head_dim]
    v = value.float().permute(1, 0, 2)
    scores = torch.einsum("hgqd,hkd->hgqk", q, k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,hkd->hgqd", probs, v)  # [num_kv_heads, group, q_len, v_head_dim]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, -1).to(query.dtype)


class TorchAttentionBackend:
    name = "torch"
    graph_safe = False  # loops over the host copies of the lengths
    fuses_rope = False

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            row = metadata.block_table[i]
            key = gather_context(kv_cache[0], row, seq_len)
            value = gather_context(kv_cache[1], row, seq_len)
            out[lo:hi] = causal_attention(query[lo:hi], key, value, scale)
        return out
