"""Moving the accepted path's K/V into place after a tree verify.

The verify step writes node t of a sequence's tree at context position prefix_len + t (prefix_len:
the context before the step, so the root sits at prefix_len). After acceptance the path's node at
depth d must sit at prefix_len + d, where the next step expects it; nodes off the path are simply
overwritten later. A node's index is at least its depth (parents come first), so every move goes
down or stays, no destination is a later move's source, and gathering all sources before writing
any is enough.

The moves have a fixed shape, [B * (depth + 1)], for CUDA graphs: entries that need no move
(a node already in place, past the path's end) copy the root's slot onto itself, which no real
move writes. The target's cache and a draft's cache index the same flat token slots
(AttentionMetadata.with_block_size), so one set of moves serves both.
"""

from __future__ import annotations

import torch


def compaction_slots(
    accepted_nodes: torch.Tensor,  # [B, depth + 1] int64 node indices from the root, -1 past the path's end
    prefix_lens: torch.Tensor,  # [B] int64, context length before the step (the root's position)
    block_table: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (src_slots, dst_slots): [B * (depth + 1)] int64 each
    batch, width = accepted_nodes.shape
    depth = torch.arange(width, device=accepted_nodes.device).expand(batch, -1)  # [B, depth + 1]
    on_path = accepted_nodes >= 0
    moves = on_path & (accepted_nodes != depth)
    src_pos = prefix_lens.unsqueeze(1) + torch.where(moves, accepted_nodes, 0)
    dst_pos = prefix_lens.unsqueeze(1) + torch.where(moves, depth, 0)
    return _slots(block_table, src_pos, block_size).flatten(), _slots(block_table, dst_pos, block_size).flatten()


def apply_slot_moves(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, ...] (one layer's K and V)
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """cache[slot dst] = cache[slot src] for every pair, all sources read before any write."""
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} differ")
    flat = kv_cache.flatten(1, 2)  # [2, num_slots, ...] (a view)
    if flat.element_size() == 1:  # FP8 caches: move the bytes (index_copy_ has no float8 kernels)
        flat = flat.view(torch.uint8)
    moved = flat.index_select(1, src_slots)  # [2, M, ...], a copy: the sources as they were
    flat.index_copy_(1, dst_slots, moved)


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = block_table.gather(1, positions // block_size).to(torch.int64)
    return blocks * block_size + positions % block_size
