"""Adaptive speculation's start-up step costs, timed on the captured CUDA graphs (issue 28).

A steady step under adaptive speculation that verifies k drafts and drafts k replays the target's
verify graph (batch bucket, q = k + 1 rows a sequence) and the draft loop's graph (bucket, q,
m = k drafts). Replaying both a few times under CUDA events, for every k at one graph bucket per
power-of-two batch (the cost buckets of engine/step_costs.py), gives each (batch, k) its device
time before the first request: the priors LearnedStepCosts seeds its cells with. A replay holds
no host work (input packing, verification on the host side, the engine's postprocess); the
engine's own timed steps still add that and override the priors (step_costs.py).

Cost: TIMED_REPLAYS + 1 of each graph for K + 1 = 5 draft lengths at 9 batches (1 .. 256) is 360
replays, a few seconds at Llama-8B size on the H200 (the estimate: docs/perf-log.md, "step costs
seeded from graph replays"); the timing stops starting new batches after BUDGET_SECONDS (the batches
left learn from steps alone). Only the single-device runner with captured target and draft-loop
graphs times anything: the CPU, --enforce-eager, host drafters (n-gram, suffix: their drafting is
host work) and tensor parallelism (every rank would have to stop at the same batch) seed nothing.

time_step_priors takes its timer as an argument (ReplayTimer), and GraphReplayTimer its timing
function, so a test on the CPU drives the measurement with fake timers, or over a CPU runner's
uncaptured graphs (the same buffers, run eagerly) with a wall clock.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

import torch

from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.spec_decode.draft_graph import DraftGraphRunner

#: Timed replays of each graph (after one untimed); their mean is its time.
TIMED_REPLAYS = 3
#: The context (tokens) each sequence of a timed replay attends to: the attention's share of a
#: step at that length (a run's contexts grow past it; the timed steps follow).
CONTEXT_TOKENS = 256
#: No batch is started after this many seconds of timing.
BUDGET_SECONDS = 5.0


class ReplayTimer(Protocol):
    """Seconds of one replay of a captured graph."""

    def verify_seconds(self, bucket: int, q: int) -> float:
        """The target's verify graph: bucket sequences of q rows each."""
        ...

    def draft_seconds(self, bucket: int, q: int, m: int) -> float:
        """The draft loop after a verify of q rows: catch-up and m drafts for bucket sequences."""
        ...


def prior_batches(graph_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """(batch, graph bucket): each power of two up to the largest graph bucket, and the graph
    bucket its steps replay (the smallest that holds it)."""
    out, batch = [], 1
    while batch <= graph_buckets[-1]:
        out.append((batch, next(b for b in graph_buckets if b >= batch)))
        batch *= 2
    return out


def time_step_priors(
    graph_buckets: Sequence[int],
    max_k: int,
    timer: ReplayTimer,
    budget_seconds: float = BUDGET_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, list[float]]:
    """{batch: [K + 1] seconds of a steady step drafting k}: verify(bucket, k + 1) + draft(bucket,
    k + 1, k) per prior_batches() entry, smallest first, until budget_seconds have passed."""
    if max_k < 1 or not graph_buckets:
        raise ValueError(f"timing step priors needs max_k >= 1 and graph buckets; got {max_k}, {list(graph_buckets)}")
    start, priors = clock(), {}
    for batch, bucket in prior_batches(graph_buckets):
        if clock() - start > budget_seconds:
            break
        priors[batch] = [timer.verify_seconds(bucket, k + 1) + timer.draft_seconds(bucket, k + 1, k)
                         for k in range(max_k + 1)]
    return priors


def cuda_event_seconds(replay: Callable[[], None], replays: int) -> float:
    """Seconds of one call of replay() on the device: the mean of `replays` calls timed by CUDA
    events, after one untimed call (the first replay after other graphs may meet cold caches)."""
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / replays


class GraphReplayTimer:
    """A ReplayTimer over the runner's graphs: the target's verify forward (CudaGraphRunner.replay)
    and the padded step's draft loop (DraftGraphRunner.run), timed by time_replays (CUDA events on
    the GPU; a test on the CPU passes its own and the uncaptured graphs run eagerly). Each replay
    runs bucket sequences of context_len tokens over cache blocks 0, 1, ...
    (CudaGraphRunner.prepare_replay), their rows at the context's last positions, writing their
    KV there as a real step does (the target's rows and the draft loop's, every sequence live).
    Only for start-up, before any request: no sequence holds those blocks, and a request writes
    a position's KV before it reads it. The next real step rewrites the graphs' inputs."""

    def __init__(self, target: CudaGraphRunner, draft_loop: DraftGraphRunner, context_len: int,
                 time_replays: Callable[[Callable[[], None], int], float] = cuda_event_seconds,
                 replays: int = TIMED_REPLAYS):
        self.target = target
        self.draft_loop = draft_loop
        self.context_len = context_len
        self.time_replays = time_replays
        self.replays = replays

    def _prepare(self, bucket: int, q: int) -> None:
        target = self.target
        target.prepare_replay((bucket, q), self.context_len)
        # Blocks 0, 1, ... in order: a position's slot is the position itself.
        rows = torch.arange(self.context_len - q, self.context_len, device=target.device).repeat(bucket)  # [bucket * q]
        target.positions[: bucket * q].copy_(rows)
        target.slot_mapping[: bucket * q].copy_(rows)

    def verify_seconds(self, bucket: int, q: int) -> float:
        self._prepare(bucket, q)
        return self.time_replays(lambda: self.target.replay((bucket, q)), self.replays)

    def draft_seconds(self, bucket: int, q: int, m: int) -> float:
        """(Uncaptured, the loop reads the outputs of the target's last run: time verify_seconds
        of the same (bucket, q) first, as time_step_priors does.)"""
        loop = self.draft_loop
        if loop.skips(m):  # no drafter runs
            return 0.0
        self._prepare(bucket, q)
        loop.num_live.fill_(bucket)  # every sequence writes its draft KV, as in a real step
        loop.accepted[:bucket].fill_(q - 1)
        loop.next_token[:bucket].fill_(0)
        try:
            return self.time_replays(lambda: loop.run(bucket, bucket, q, m), self.replays)
        finally:
            # Back to the state the loop was built in: a real step's verifier writes these for its
            # live sequences only, and a padding sequence's row a (seq * q + accepted) must stay in
            # its own q rows (an accepted count of this q - 1 left behind overruns a shorter q: an
            # out-of-range gather on the first real step, seen on the H200 at f6dfe7f).
            loop.accepted.zero_()
            loop.next_token.zero_()
            loop.num_live.zero_()


def replay_timer_for(
    target: CudaGraphRunner | None,
    draft_loop: object,  # the runner's padded draft loop: DraftGraphRunner, HostDraftSlots or None
    max_k: int,
    max_context_tokens: int,  # what one sequence may hold: max_model_len and the KV cache's blocks
) -> GraphReplayTimer | None:
    """A timer over the runner's graphs when every graph a steady adaptive step replays was
    captured (verify (bucket, k + 1), draft loop (bucket, k + 1, k) at every bucket and k, but none
    for k = 0 when that step runs no drafter: DraftGraphRunner.skips), else None."""
    if target is None or not target.captures or not isinstance(draft_loop, DraftGraphRunner):
        return None
    keys = [(b, k + 1) for b in target.buckets for k in range(max_k + 1)]
    if any(key not in target.graphs for key in keys) or any(
            (*key, key[1] - 1) not in draft_loop.graphs and not draft_loop.skips(key[1] - 1) for key in keys):
        return None
    context_len = min(CONTEXT_TOKENS, max_context_tokens)
    if context_len < max_k + 1:
        return None
    return GraphReplayTimer(target, draft_loop, context_len)


def measure_step_priors(target: CudaGraphRunner | None, draft_loop: object, max_k: int,
                        max_context_tokens: int) -> dict[int, list[float]] | None:
    """The start-up priors of a runner's graphs (time_step_priors), or None where nothing is timed
    (module docstring)."""
    timer = replay_timer_for(target, draft_loop, max_k, max_context_tokens)
    if timer is None:
        return None
    with torch.inference_mode():
        priors = time_step_priors(target.buckets, max_k, timer)
    torch.cuda.synchronize(target.device)
    return priors
