"""Moving small host lists to the device without stalling it.

torch.tensor(values, device="cuda") copies from pageable memory, which waits for every kernel
already queued; building the tensor on the host, pinning it and copying asynchronously does not.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
