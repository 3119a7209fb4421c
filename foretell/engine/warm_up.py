"""Start-up warm-up: dummy requests through the whole engine before the first real one.

Triton compiles a kernel variant the first time it meets a new combination of constexpr tiles
(derived from the query length, the number of tokens, the pairs per expert) and of integer
arguments' specialisation (1, a multiple of 16, other), each compile far longer than a step. CUDA
graphs cover decode and verify steps, not prefill: on the H200 the first GSM8K prompts of a fresh
engine took many times a steady prompt's time, compiling inside the first requests
(docs/perf-log.md, fifth GPU session). The warm-up runs prompts whose lengths cover the tile
variants (powers of two and their neighbours, up to the chunked-prefill budget), one at a time and
then together, each for a few verify or decode steps, through the scheduler, runner and drafter
exactly as requests run, and once more over the prefix cache (prefills of a query after a cached
context), then short tails after one long cached prefix (cached_tail_prompts). Afterwards nothing of
it remains: counters, the prefix cache, the suffix drafter's cache of responses and the KV blocks
are as they were.
"""

from __future__ import annotations

import time

from foretell.engine.metrics import EngineMetrics
from foretell.sampling_params import SamplingParams

# Prompt lengths: every power-of-two tile of the query length, both sides of a multiple of 16.
PROMPT_LENGTHS = (1, 2, 3, 5, 9, 16, 17, 31, 33, 64, 100, 129, 257, 513, 1025, 2049, 4097)


def warm_up(engine) -> float:
    """Run the dummy requests; returns the seconds they took."""
    start = time.perf_counter()
    k = engine.config.speculative.num_speculative_tokens if engine.config.speculative else 0
    longest = min(engine.max_model_len - 2 * (k + 2), engine.config.scheduler.max_num_batched_tokens * 2)
    lengths = [n for n in PROMPT_LENGTHS if n <= longest]
    vocab = engine.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2 * (k + 1) + 2, ignore_eos=True)
    prompts = {f"warm-up-{n}": [(7 * i + 3) % vocab for i in range(n)] for n in lengths}
    for request_id, tokens in prompts.items():  # batch 1: each prefill shape, then decode / verify
        _run(engine, {request_id: tokens}, params)
    if engine.config.cache.enable_prefix_caching:
        # The same prompts again hit the prefix cache: prefills over a cached prefix (a context
        # longer than the query) are other kernel variants, met in serving by repeated prompts.
        for request_id, tokens in prompts.items():
            _run(engine, {f"{request_id}-cached": tokens}, params)
        for request_id, tokens in cached_tail_prompts(longest, engine.facts.cache_plan.block_size, vocab).items():
            _run(engine, {request_id: tokens}, params)  # one at a time: each tail after the cached base
    _run(engine, {f"{r}-batched": t for r, t in prompts.items()}, params)  # mixed batches
    if engine.config.speculative is not None and engine.config.speculative.adaptive:
        # Adaptive speculation's policy starts after the warm-up, which drafts K every step: every k
        # in 0..K (k = 0 a plain decode step, decode_ahead.py's zero_drafts_only route), held for a
        # few steps each, so their kernels compile here and not in the first requests.
        engine.scheduler.draft_length = EveryDraftCount(k)
        first = next(iter(prompts.items()))
        _run(engine, {f"{first[0]}-every-k": first[1]}, params)
        _run(engine, {f"{r}-every-k-batched": t for r, t in prompts.items()}, params)
        engine.scheduler.draft_length = None
    leave_no_trace(engine)
    return time.perf_counter() - start


# The longest cached prefix the tails follow: long enough that a one-row-block query over it splits
# its context (triton_paged_launch.choose_num_splits), short enough to cost little.
TAIL_BASE_TOKENS = 512
MAX_TAIL = 16  # the one-launch RoPE + attention's largest query block (triton_rope_paged.fits)


def cached_tail_prompts(longest: int, block_size: int, vocab: int) -> dict[str, list[int]]:
    """A base prompt of whole KV blocks, then the base followed by 1..MAX_TAIL more tokens: run in
    this order, each of the latter prefills only its tail over the cached base. Those are the
    one-launch attention's query blocks with a split context, which repeated prompts that differ
    in their last tokens meet in serving (a chat's next turn, a template with another question)
    and the cached pass above, whose prompts are short where their tails are long, does not.
    Empty when the engine holds no base of at least two blocks and a tail."""
    base_len = min(TAIL_BASE_TOKENS, longest - MAX_TAIL) // block_size * block_size
    if base_len < 2 * block_size:
        return {}
    base = [(11 * i + 5) % vocab for i in range(base_len)]
    prompts = {"warm-up-tail-base": base}
    for tail in range(1, MAX_TAIL + 1):
        prompts[f"warm-up-tail-{tail}"] = base + [(13 * i + 2) % vocab for i in range(tail)]
    return prompts


class EveryDraftCount:
    """The warm-up's draft-length policy under adaptive speculation (a scheduler DraftLength): k = 0,
    1, .., K in turn, each for STEPS_EACH steps in a row (a k = 0 step queued after a k = 0 step
    takes its own route), whatever the batch; it learns nothing."""

    STEPS_EACH = 3

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.num_chosen = 0
        self.chosen: list[int] = []

    def choose(self, batch_size: int) -> int:
        k = (self.num_chosen // self.STEPS_EACH) % (self.max_k + 1)
        self.num_chosen += 1
        self.chosen.append(k)
        return k

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass


def _run(engine, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    for request_id, tokens in prompts.items():
        try:
            engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
        except ValueError:  # a small KV cache: skip what does not fit
            continue
    while engine.has_unfinished_requests():
        engine.step()


def leave_no_trace(engine) -> None:
    """After synthetic requests (the warm-up, step-cost probes): fresh counters, no cached
    prefixes, no step queued ahead, no response cached for drafting (the suffix drafter's)."""
    engine.runner.reset_pipeline()
    engine.runner.drop_cached_responses()
    engine.scheduler.num_preemptions = 0
    engine.block_manager.reset_prefix_cache()
    old = engine.metrics
    engine.metrics = EngineMetrics(
        spec=type(old.spec)(old.spec.num_speculative_tokens) if old.spec is not None else None,
        synthetic_acceptance=old.synthetic_acceptance,
    )
