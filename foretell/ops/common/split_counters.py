"""Counters that let the last of a launch's programs know it is last (split attention merges the
pieces of a context, the split-K MMA sums its partial products): zero between launches, allocated
once per device so a CUDA graph can hold their address. Plain torch: importing this loads no triton.
"""

from __future__ import annotations

import torch


class SplitCounters:
    """Counters of finished split programs, one int32 per (query block, head group) of a launch,
    zero between launches (the merging program resets its own). The attention backend owns one
    for the process, so a CUDA graph can capture its address: it is allocated at the first eager
    launch and must not grow during capture."""

    MIN_COUNT = 1 << 20  # covers decode / verify batches of thousands of sequences

    def __init__(self, min_count: int = MIN_COUNT):
        self.min_count = min_count  # the first allocation's size, so later launches rarely grow it
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, count: int) -> torch.Tensor:  # [>= count] int32, zero
        counters = self._buffers.get(device)
        if counters is None or counters.numel() < count:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"split attention needs {count} counters on {device} but has "
                    f"{0 if counters is None else counters.numel()}; they cannot be allocated during "
                    "CUDA graph capture (run the same shapes eagerly first)"
                )
            counters = torch.zeros(max(count, self.min_count), dtype=torch.int32, device=device)
            self._buffers[device] = counters
        return counters
