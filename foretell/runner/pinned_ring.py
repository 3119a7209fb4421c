"""Host buffers and CUDA events reused in turn, for the copies between host and device each step.

A decode step copies its packed inputs to the device and its tokens back. Allocating a pinned
tensor and a CUDA event for each copy costs the host tens of microseconds a step (pinned memory
comes from the caching host allocator, and each event is a new driver object): for a small model
on an H200 the host's work IS the step time (runner/step_pipeline.py). A ring of `depth` slots,
each a pinned buffer (grown when a copy needs more) and an event recorded after the slot's last
copy, is allocated once and used in turn. Before a slot is handed out again its event is waited
for, so a slot is never rewritten while a copy still reads or writes it; with the step pipeline at
most two copies of a ring are pending (the step being read and the one queued after it), far
below the depth.

A copy's reader holds a RingSlot; `check()` raises if the ring has handed that slot out again
since (its data would be another copy's): a bug in the caller, never silent.

Off CUDA the buffers are plain host tensors and no event is made (copies there are synchronous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingSlot:
    ring: "PinnedRing"
    index: int
    generation: int  # the ring's hand-out count of this slot when it was taken

    def check(self) -> None:
        if self.ring.generations[self.index] != self.generation:
            raise RuntimeError(
                f"pinned ring slot {self.index} was reused before its copy was read "
                f"(ring depth {len(self.ring.buffers)}): more copies pending than the ring holds"
            )


class PinnedRing:
    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int = 64, depth: int = 4):
        if depth < 2:
            raise ValueError(f"depth must be >= 2 (a copy pending while the next is made), got {depth}")
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.buffers = [self._allocate(numel) for _ in range(depth)]
        # numpy views of the buffers: a list of Python ints lands in one in a few microseconds,
        # where torch.tensor(list) and a copy take several times that (take_array)
        self.arrays = [buffer.numpy() for buffer in self.buffers]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(depth)]
        self.recorded = [False] * depth  # whether the slot's event was ever recorded
        self.generations = [0] * depth
        self.next_index = 0

    def _allocate(self, numel: int) -> torch.Tensor:
        return torch.empty(max(numel, 1), dtype=self.dtype, pin_memory=self.cuda)

    def take(self, numel: int) -> tuple[torch.Tensor, "torch.cuda.Event | None", RingSlot]:
        """(the next slot's buffer, its first `numel` elements; its event, to be recorded after
        the copy that uses it; the slot), once the slot's previous copy has finished."""
        i = self.next_index
        self.next_index = (i + 1) % len(self.buffers)
        if self.recorded[i]:
            self.events[i].synchronize()  # long done in a steady pipeline
        if self.buffers[i].numel() < numel:
            self.buffers[i] = self._allocate(max(numel, 2 * self.buffers[i].numel()))
            self.arrays[i] = self.buffers[i].numpy()
        self.generations[i] += 1
        if self.cuda:
            self.recorded[i] = True  # the caller records it right after queuing its copy
        return self.buffers[i][:numel], self.events[i], RingSlot(self, i, self.generations[i])

    def take_filled(self, values: list) -> tuple[torch.Tensor, "torch.cuda.Event | None", RingSlot]:
        """take(len(values)) with the buffer holding `values` (Python numbers of the ring's dtype)."""
        host, event, slot = self.take(len(values))
        self.arrays[slot.index][: len(values)] = values
        return host, event, slot
