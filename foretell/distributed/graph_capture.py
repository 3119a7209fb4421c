"""Whether a tensor-parallel rank may capture CUDA graphs and queue steps ahead, and why.

  decision = graph_capture_decision(tp, device)   # GraphDecision(allowed, reason)

A CUDA graph records kernels on the GPU's stream. Under tensor parallelism the target's forward
holds collectives (the row-parallel all-reduces, the vocabulary-parallel all-gathers, the greedy
pick's all-gather), so the graph must record them too:

- NCCL collectives are GPU kernels on a stream: torch's ProcessGroupNCCL records them into a graph
  being captured, and a replay runs them again with the same buffers. Every rank gets the same
  plan in the same order and picks the same graph for it (the bucket depends on the plan only),
  so the ranks replay the same graph in lock-step and its collectives pair up, as the eager
  forward's do. The communicator is created by the start-up's first collective (the KV block
  agreement), before any capture, as capture requires. Queued-ahead steps follow: a rank launches
  the same next step every other rank launches, from the same results.
- gloo collectives run on the host (CPU tensors, TCP): nothing of them can live in a CUDA graph,
  and the CPU runs no graphs anyway. Such ranks stay eager and queue nothing ahead.
- One rank has no collectives: the one-device rules apply.

A capture that fails on one rank cannot fall back to eager there alone (its peers may sit in a
collective inside their capture): under tensor parallelism a failed capture is a start-up error.

Imports nothing of the package above distributed/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GraphDecision:
    allowed: bool
    reason: str


def group_backend(tp: Any) -> str | None:
    """The backend of the rank's process group ("nccl", "gloo"), None with one rank."""
    if not tp.is_parallel:
        return None
    import torch.distributed as dist

    return str(dist.get_backend(tp.group)).lower()


def graph_capture_decision(tp: Any, device: torch.device, backend: str | None = None) -> GraphDecision:
    """May this rank capture its target's CUDA graphs (collectives included) and queue steps
    ahead? backend: the group's (None: asked of the group)."""
    if not tp.is_parallel:
        return GraphDecision(True, "one rank: no collectives in the forward")
    backend = group_backend(tp) if backend is None else backend.lower()
    if device.type != "cuda":
        return GraphDecision(False, f"tensor parallel on {device.type}: no CUDA graphs there; ranks run eagerly")
    if backend != "nccl":
        return GraphDecision(
            False, f"tensor parallel over {backend}: its collectives run on the host and cannot be "
                   f"captured in a CUDA graph; ranks run eagerly and queue nothing ahead")
    return GraphDecision(
        True, "tensor parallel over nccl: the collectives are captured with the forward, and every "
              "rank replays the same graph for the same plan")
