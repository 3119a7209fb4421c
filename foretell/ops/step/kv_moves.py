"""Moving cached K/V rows between slots in every layer at once: the draft-tree step's compaction
(spec_decode/tree/compact.py computes the moves; issue 28).

After a tree verify each sequence's accepted path moves to consecutive slots after its root, in
every target layer, K and V alike. The per-layer path (compact.apply_slot_moves) is one gather and
one scatter per layer: 64 launches for Llama-8B's 32 layers. KVMoveTargets holds the layers'
caches as one base tensor plus each layer's element offset from it, so a single Triton launch
(triton_kv_moves.py) moves every layer's rows; its torch twin (move_kv_slots_torch) runs the moves
layer by layer, and is what runs off CUDA.

The moves come as [B * M] source and destination slots, M per sequence in path order (depth 0 ..
depth): a move's destination is never a later move's source within its sequence (a path's node at
depth d has index >= d, and indices increase along the path), and sequences' slots are disjoint, so
one program per (layer, K or V, sequence) may run its M moves in order, and entries with source ==
destination are no-ops.
"""

from __future__ import annotations

import torch

from foretell.ops.common import kernel_choice


class KVMoveTargets:
    """Every layer's cache [2, num_blocks, block_size, ...] (same shape, dtype, device; contiguous),
    addressed from the first one: layer l's elements start layer_offsets[l] elements past it."""

    def __init__(self, caches: list[torch.Tensor]):
        if not caches:
            raise ValueError("KVMoveTargets needs at least one layer's cache")
        first = caches[0]
        for i, cache in enumerate(caches):
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise ValueError(f"layer {i}'s cache {tuple(cache.shape)} {cache.dtype} on {cache.device} differs "
                                 f"from layer 0's {tuple(first.shape)} {first.dtype} on {first.device}")
            if not cache.is_contiguous() or cache.dim() < 3 or cache.shape[0] != 2:
                raise ValueError(f"layer {i}'s cache must be a contiguous [2, num_blocks, block_size, ...] tensor, "
                                 f"got {tuple(cache.shape)} strides {cache.stride()}")
        self.caches = list(caches)
        # FP8 caches move as bytes (the kernel and index_copy_ then need no float8 support).
        self.views = [c.view(torch.uint8) if c.element_size() == 1 else c for c in caches]
        base = self.views[0]
        size = base.element_size()
        gaps = [v.data_ptr() - base.data_ptr() for v in self.views]
        # One base pointer serves every layer when the allocations sit a whole element apart (always,
        # for the allocator's aligned blocks); else the launch falls back to the per-layer twin.
        self.single_base = all(g % size == 0 for g in gaps)
        self.layer_offsets = torch.tensor([g // size for g in gaps], dtype=torch.int64,
                                          device=first.device)  # [num_layers], elements from base
        self.num_slots = first.shape[1] * first.shape[2]
        self.row_elems = first[0, 0, 0].numel()  # one slot's K (or V) elements: heads x head_dim

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    def holds(self, caches: list[torch.Tensor]) -> bool:
        """Whether these are still the caches this was built over (the runner binds them once)."""
        return len(caches) == len(self.caches) and all(a is b for a, b in zip(caches, self.caches))


def move_kv_slots_torch(
    targets: KVMoveTargets,
    src_slots: torch.Tensor,  # [B * M] int64
    dst_slots: torch.Tensor,  # [B * M] int64
) -> None:
    """cache[:, dst] = cache[:, src] in every layer, all sources read before any write (per layer)."""
    for view in targets.views:
        flat = view.flatten(1, 2)  # [2, num_slots, ...] (a view)
        flat.index_copy_(1, dst_slots, flat.index_select(1, src_slots))


def move_kv_slots(
    targets: KVMoveTargets,
    src_slots: torch.Tensor,  # [B * M] int64, M moves per sequence in path order
    dst_slots: torch.Tensor,  # [B * M] int64
    moves_per_seq: int,  # M (depth + 1)
) -> None:
    """Every layer's K/V moved: one Triton launch on CUDA, else the per-layer torch twin."""
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} must be "
                         "the same 1-D shape")
    if moves_per_seq < 1 or src_slots.numel() % moves_per_seq:
        raise ValueError(f"moves_per_seq={moves_per_seq} must divide the {src_slots.numel()} moves")
    if targets.single_base and kernel_choice.use_triton(src_slots, targets.caches[0]):
        from foretell.ops.step import triton_kv_moves  # imports triton: CUDA only

        triton_kv_moves.move_kv_slots_triton(targets, src_slots, dst_slots, moves_per_seq)
        return
    move_kv_slots_torch(targets, src_slots, dst_slots)
