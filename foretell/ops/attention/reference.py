"""Plain-torch attention over the paged cache: the reference every kernel is held to.

Runs on any device. Loops over sequences on the host (the metadata carries host copies of the
lengths, so there is no device sync); each sequence gathers its context from its block table and
attends with a causal mask offset by its cached prefix. Scores and softmax are computed in float32.

A draft tree's forward passes tree_mask [num_tokens, W] bool whose W columns address each
sequence's last W keys (positions seq_len - W .. seq_len - 1, after the step's writes): a query row
sees every key before those, and of the last W only those its mask row marks (its ancestors and
itself), always combined with the causal limit (tree nodes are topologically ordered). For a tree
verify the last W keys are the tree's own rows; a drafter's depth forward runs only its newest
frontier rows and reaches the earlier ones, cached at the keys just before, through the same
columns. Columns before a sequence's first key are ignored. An all-true mask is plain causal
attention.

An FP8 cache (fp8_kv.py) stores x / scale in e4m3 and is read back as e4m3 * scale in float32, the
layer's k_scale for keys and v_scale for values; other caches ignore the scales.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from foretell.ops.attention.fp8_kv import dequantize_from_cache, index_copy_slots, is_fp8, quantize_for_cache
from foretell.ops.attention.metadata import AttentionMetadata


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: float = 1.0,  # FP8 caches: stored keys are key / k_scale
    v_scale: float = 1.0,
) -> None:
    flat = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim] (a view)
    if is_fp8(kv_cache.dtype):
        key = quantize_for_cache(key, kv_cache.dtype, k_scale)
        value = quantize_for_cache(value, kv_cache.dtype, v_scale)
        index_copy_slots(flat[0], slot_mapping, key)
        index_copy_slots(flat[1], slot_mapping, value)
        return
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:  # (a no-op cast still costs a dispatch)
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def write_kv_pair_torch(
    key_value: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim]: keys and values side by side
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, key_value's dtype
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """write_kv_torch for keys and values that sit side by side (a view of a fused q|k|v
    projection's output, laid out as the cache's [2, ...]): one index_copy_ instead of two."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, slot_mapping, key_value.transpose(0, 1))


def sequence_rows(metadata: AttentionMetadata) -> Iterator[tuple[int, int, int, int]]:
    """(i, lo, hi, seq_len) of each sequence with query rows in the step, from the metadata's host
    copies: its rows are query[lo:hi], its context the first seq_len entries of block_table[i]."""
    starts = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            yield i, lo, hi, seq_len


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, ...]
    block_table_row: torch.Tensor,  # [max_blocks] int32 or int64
    seq_len: int,
) -> torch.Tensor:  # [seq_len, ...]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table_row[:num_blocks])  # int32 indices: no cast launch
    return blocks.flatten(0, 1)[:seq_len]


def causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, v_head_dim]
    scale: float,
    tree_mask: torch.Tensor | None = None,  # [q_len, W] bool: which of the last W keys each row sees
) -> torch.Tensor:  # [q_len, num_heads, v_head_dim]
    """Queries are the last q_len positions of a seq_len context.

    Two batched matmuls over the kv heads, each head's query group and rows stacked as
    [num_kv_heads, group * q_len, head_dim]; a single query row sees every key, so it needs no
    mask (few launches: on the CPU a decode step's cost is mostly per-op overhead)."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    # [num_kv_heads, group * q_len, head_dim]
    if q_len == 1:  # a decode row: [num_heads, head_dim] is already [num_kv_heads, group, head_dim]
        q = query.float().reshape(num_kv_heads, group, -1)
    else:
        q = query.float().view(q_len, num_kv_heads, group, -1).permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, -1)
    k = key.float().permute(1, 2, 0)  # [num_kv_heads, head_dim, seq_len]
    v = value.float().permute(1, 0, 2)  # [num_kv_heads, seq_len, v_head_dim]
    scores = torch.bmm(q, k).mul_(scale)  # [num_kv_heads, group * q_len, seq_len]
    if q_len > 1 or tree_mask is not None:
        # query row j sits at position seq_len - q_len + j and sees keys 0..that position
        hidden = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device).triu_(seq_len - q_len + 1)
        if tree_mask is not None:
            width = min(tree_mask.shape[1], seq_len)  # a mask wider than the context: its first columns address nothing
            last_keys = hidden[:, seq_len - width :]  # [q_len, width] (a view)
            last_keys |= ~tree_mask[:, tree_mask.shape[1] - width :].to(device=query.device, dtype=torch.bool)
        scores = scores.view(num_kv_heads, group, q_len, seq_len).masked_fill_(hidden, float("-inf"))
        scores = scores.view(num_kv_heads, group * q_len, seq_len)
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v)  # [num_kv_heads, group * q_len, v_head_dim]
    if q_len == 1:
        out = out.view(1, num_heads, -1)
    else:
        out = out.view(num_kv_heads, group, q_len, -1).permute(2, 0, 1, 3).reshape(q_len, num_heads, -1)
    return out if out.dtype == query.dtype else out.to(query.dtype)


class TorchAttentionBackend:
    name = "torch"
    graph_safe = False  # loops over the host copies of the lengths
    fuses_rope = False

    def write_kv(self, key, value, kv_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # FP8 caches: what a stored key / value is multiplied by
        v_scale: float = 1.0,
        tree_mask: torch.Tensor | None = None,  # [num_tokens, W] bool over each sequence's last W keys (module docstring)
    ) -> torch.Tensor:
        starts = metadata.query_start_loc_cpu
        if len(starts) == 2 and starts[1] == query.shape[0] > 0:  # one sequence, every row: no output buffer
            key, value = gather_kv(kv_cache, metadata.block_table[0], metadata.seq_lens_cpu[0], k_scale, v_scale)
            return causal_attention(query, key, value, scale, tree_mask)
        out = torch.empty_like(query)
        for i, lo, hi, seq_len in sequence_rows(metadata):
            key, value = gather_kv(kv_cache, metadata.block_table[i], seq_len, k_scale, v_scale)
            out[lo:hi] = causal_attention(query[lo:hi], key, value, scale,
                                          None if tree_mask is None else tree_mask[lo:hi])
        return out


def gather_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks] int32 or int64
    seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # key, value: [seq_len, num_kv_heads, head_dim] each
    """gather_context for the key and the value cache in one gather (an FP8 cache's entries
    dequantized to float32 with their scales)."""
    num_blocks = -(-seq_len // kv_cache.shape[2])
    blocks = kv_cache.index_select(1, block_table_row[:num_blocks])  # [2, num_blocks, block_size, ...]
    context = blocks.flatten(1, 2)[:, :seq_len]  # [2, seq_len, num_kv_heads, head_dim]
    if is_fp8(kv_cache.dtype):
        return (dequantize_from_cache(context[0], k_scale, torch.float32),
                dequantize_from_cache(context[1], v_scale, torch.float32))
    return context[0], context[1]
