"""Batch-size buckets for the step costs the engine learns from its own steps: adaptive
speculation's cost table (engine/step_costs.py) and suffix decoding's cost-aware gate
(spec_decode/suffix_gate.py). A bucket is a power of two named by its smallest batch (1, 2-3,
4-7, ...); a cost is the lower median of a cell's recent times (robust to a slow spell of a shared
machine). Pure Python, no torch."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Iterable, Sequence


def bucket_of(batch_size: int) -> int:
    """The power of two at or below batch_size: the smallest batch of its bucket."""
    return 1 << (max(1, batch_size).bit_length() - 1)


def nearest_bucket(candidates: Iterable[int], bucket: int) -> int:
    """The candidate bucket nearest to `bucket` in powers of two (ties: the smaller batch)."""
    return min(candidates, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))


def lower_median(values: Sequence[float]) -> float:
    """The lower median of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def low_quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of a non-empty sequence, rounded down to a value of it (the
    floor((n - 1) * q)-th smallest; q = 0.5: the lower median)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile needs 0 <= q <= 1, got {q!r}")
    ordered = sorted(values)
    return ordered[int((len(ordered) - 1) * q)]


class SlidingQuantile:
    """The last `window` values, kept sorted as they come (a value in, the oldest out: no sort per
    read), for low_quantile's q-quantile of them in O(1)."""

    __slots__ = ("order", "ordered")

    def __init__(self, window: int):
        self.order: deque[float] = deque(maxlen=window)  # arrival order
        self.ordered: list[float] = []  # the same values, sorted

    def append(self, value: float) -> None:
        order = self.order
        if len(order) == order.maxlen:
            del self.ordered[bisect_left(self.ordered, order[0])]
        order.append(value)
        insort(self.ordered, value)

    def quantile(self, q: float) -> float:
        """low_quantile(values, q) (the values must not be empty)."""
        ordered = self.ordered
        return ordered[int((len(ordered) - 1) * q)]

    def clear(self) -> None:
        self.order.clear()
        self.ordered.clear()

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order)
