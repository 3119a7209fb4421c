"""Batch-size buckets for the step costs the engine learns from its own steps: adaptive
speculation's cost table (engine/step_costs.py) and suffix decoding's cost-aware gate
(spec_decode/suffix_gate.py). A bucket is a power of two named by its smallest batch (1, 2-3,
4-7, ...); a cost is the lower median of a cell's recent times (robust to a slow spell of a shared
machine). Pure Python, no torch."""

from __future__ import annotations

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
