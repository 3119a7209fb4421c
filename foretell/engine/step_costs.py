"""Start-up measurement for adaptive speculation: what one engine step costs, by batch size and by
the number of drafts k each sequence verifies (0..K), as a StepCostModel (spec_decode/adaptive.py).

Whole engine steps are timed, not the target forward alone: a step that verifies k drafts also
drafts k for the next one, schedules and detokenizes, and which path it takes (the padded verify
step, CUDA graphs of k + 1 rows, the host step) depends on k. So for each batch size B (powers of
two up to max_num_seqs, and max_num_seqs itself) and each k the measurement runs B dummy greedy
requests and fixes the scheduler's draft length at each k in turn, ROUNDS times: SETTLE_STEPS
steps pass (the first one verifies the drafts made before the switch), then TIMED_STEPS steps where
every sequence verifies k drafts are timed; the cost is the median over the rounds. Batch sizes
stop where the KV cache, the token budget or max_model_len cannot hold them (the cost model
scales per sequence past the largest). Afterwards nothing of it remains: no requests, fresh
counters, an empty prefix cache.
"""

from __future__ import annotations

import logging
import statistics
import time

from foretell.engine.warm_up import leave_no_trace
from foretell.sampling_params import SamplingParams
from foretell.spec_decode.adaptive import AdaptiveDraftLength, FixedDraftLength, StepCostModel

logger = logging.getLogger("foretell")

PROMPT_TOKENS = 8
ROUNDS = 3
SETTLE_STEPS = 1
TIMED_STEPS = 2


def measurement_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs, and max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def _max_tokens(max_k: int) -> int:
    """Output tokens a measured request needs: the prefill's token and every round's steps."""
    steps_per_round = sum((SETTLE_STEPS + TIMED_STEPS) * (k + 1) for k in range(max_k + 1))
    return 1 + ROUNDS * steps_per_round + max_k + 1


def _fits(engine, batch_size: int, max_k: int) -> bool:
    longest = PROMPT_TOKENS + _max_tokens(max_k) + engine.scheduler.num_lookahead_tokens
    block_size = engine.block_manager.block_size
    blocks = batch_size * (-(-longest // block_size) + 1)
    budget = engine.config.scheduler.max_num_batched_tokens
    return (
        longest <= engine.max_model_len
        and blocks <= engine.block_manager.num_free_blocks
        and batch_size * max(max_k + 1, PROMPT_TOKENS) <= budget
    )


def _time_batch(engine, batch_size: int, max_k: int) -> tuple[float, ...] | None:
    """Median seconds of a step where batch_size sequences verify k drafts each, for k = 0..max_k;
    None when the steps did not run as planned (a preemption, a sequence that ended early). The
    draft lengths take turns (ROUNDS rounds of every k), so that a slow spell of a shared machine
    or the contexts growing weigh on every k alike."""
    vocab = engine.facts.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=_max_tokens(max_k), ignore_eos=True)
    ids = [f"step-cost-{batch_size}-{i}" for i in range(batch_size)]
    preemptions = engine.scheduler.num_preemptions
    times: list[list[float]] = [[] for _ in range(max_k + 1)]
    try:
        engine.scheduler.draft_length = FixedDraftLength(0)
        for i, request_id in enumerate(ids):
            prompt = [(31 * i + 7 * j + 3) % vocab for j in range(PROMPT_TOKENS)]
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        seqs = [seq for request_id in ids for seq in engine.requests[request_id].seqs]
        for _ in range(4 * PROMPT_TOKENS):  # prefill (chunked prefills take a few steps)
            if all(seq.num_output_tokens >= 1 for seq in seqs):
                break
            engine.step()
        for _ in range(ROUNDS):
            for k in range(max_k + 1):
                # The step after the switch verifies the drafts made before it: settle first.
                engine.scheduler.draft_length = FixedDraftLength(k)
                for step in range(SETTLE_STEPS + TIMED_STEPS):
                    start = time.perf_counter()
                    engine.step()
                    if step >= SETTLE_STEPS:
                        times[k].append(time.perf_counter() - start)
        ran_as_planned = all(not seq.is_finished for seq in seqs)
        if engine.scheduler.num_preemptions != preemptions or not ran_as_planned:
            return None
        return tuple(statistics.median(t) for t in times)
    finally:
        for request_id in ids:
            engine.abort_request(request_id)


def measure_step_costs(engine, max_k: int) -> StepCostModel:
    """The engine's StepCostModel for k = 0..max_k (see the module docstring)."""
    saved = engine.scheduler.draft_length
    sizes: list[int] = []
    rows: list[tuple[float, ...]] = []
    try:
        for batch_size in measurement_batch_sizes(engine.config.scheduler.max_num_seqs):
            if not _fits(engine, batch_size, max_k):
                break
            row = _time_batch(engine, batch_size, max_k)
            if row is None:
                break
            sizes.append(batch_size)
            rows.append(row)
    finally:
        engine.scheduler.draft_length = saved
        engine.scheduler.draft_limit = None
        leave_no_trace(engine)
    if not sizes:
        raise ValueError(
            f"adaptive speculation measures step costs at start-up with requests of "
            f"{PROMPT_TOKENS + _max_tokens(max_k)} tokens, but the engine cannot run one (max_model_len "
            f"{engine.max_model_len}, {engine.block_manager.num_blocks} KV blocks): raise max_model_len or "
            f"the KV cache, or lower num_speculative_tokens"
        )
    return StepCostModel(tuple(sizes), tuple(rows))


def start_adaptive_speculation(engine) -> AdaptiveDraftLength:
    """Measure the step costs and hand the scheduler its adaptive draft-length policy."""
    max_k = engine.config.speculative.num_speculative_tokens
    start = time.perf_counter()
    costs = measure_step_costs(engine, max_k)
    policy = AdaptiveDraftLength(costs)
    engine.scheduler.draft_length = policy
    logger.info(
        "adaptive speculation: step costs of k = 0..%d at batch sizes %s measured in %.1f s",
        max_k, list(costs.batch_sizes), time.perf_counter() - start,
    )
    return policy
