"""runner/pinned_ring.py: slots handed out in turn, grown on demand, reuse detected; HostCopy reads
through a ring as through a fresh tensor."""

from __future__ import annotations

import pytest
import torch

from foretell.runner.pinned_ring import PinnedRing
from foretell.runner.step_pipeline import HostCopy

CPU = torch.device("cpu")


def test_slots_come_in_turn_and_grow():
    ring = PinnedRing(torch.int64, CPU, numel=4, depth=3)
    taken = [ring.take(3) for _ in range(3)]
    assert [slot.index for _, _, slot in taken] == [0, 1, 2]
    assert all(buf.numel() == 3 and buf.dtype == torch.int64 for buf, _, _ in taken)
    big, event, slot = ring.take(100)  # slot 0 again, grown
    assert slot.index == 0 and big.numel() == 100 and event is None
    big.copy_(torch.arange(100))
    assert ring.buffers[0][:100].tolist() == list(range(100))


def test_take_filled_writes_the_values_into_the_slot():
    ring = PinnedRing(torch.int64, CPU, numel=2, depth=2)
    host, _, slot = ring.take_filled([5, -1, 2**40])  # grows the slot
    assert host.tolist() == [5, -1, 2**40] and ring.buffers[slot.index][:3].tolist() == [5, -1, 2**40]


def test_a_slot_reused_before_its_read_is_reported():
    ring = PinnedRing(torch.int64, CPU, numel=4, depth=2)
    _, _, first = ring.take(1)
    first.check()  # fine while not handed out again
    ring.take(1)
    first.check()
    ring.take(1)  # slot 0 again
    with pytest.raises(RuntimeError, match="reused before its copy was read"):
        first.check()


def test_bad_depth_is_refused():
    with pytest.raises(ValueError, match="depth must be >= 2"):
        PinnedRing(torch.int64, CPU, depth=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies need CUDA")
def test_host_copies_through_a_ring_equal_the_values():
    ring = PinnedRing(torch.int64, torch.device("cuda"), numel=2, depth=2)
    for n in (1, 5, 3, 64):
        values = torch.randint(0, 1000, (n,), device="cuda")
        copy = HostCopy.queue(values, ring)
        assert copy.read() == values.tolist()


def test_host_copy_off_cuda_reads_the_values_whatever_the_ring():
    values = torch.tensor([3, 1, 4])
    assert HostCopy.queue(values, PinnedRing(torch.int64, CPU)).read() == [3, 1, 4]
