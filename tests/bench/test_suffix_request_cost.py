"""bench/suffix_request_cost.DrafterClock: the suffix drafter's parts are timed per request and per
step, the patched methods are restored, and the drafts are what an untimed drafter proposes."""

from __future__ import annotations

from foretell.bench.suffix_host_cost import _batch
from foretell.bench.suffix_request_cost import PARTS, STEP_PARTS, DrafterClock
from foretell.spec_decode import suffix_tree
from foretell.spec_decode.suffix import SuffixProposer


def drive(proposer: SuffixProposer, num_requests: int = 3, steps: int = 6) -> list[list[int]]:
    """Requests in sequence, each a prompt that repeats a pattern and a few steps that follow it."""
    drafts = []
    for r in range(num_requests):
        history = [5, 6, 7, 8, 9] * 4 + [100 + r]
        for _ in range(steps):
            out = proposer.propose(_batch([history], [r], 1000)).token_ids[0]
            drafts.append(out)
            history = history + (out[:2] or [5]) + [6]
        proposer.forget(r)
    return drafts


def test_parts_are_counted_per_request_and_per_step():
    untimed = drive(SuffixProposer(4))
    lookup = suffix_tree.SuffixIndex.lookup
    clock = DrafterClock()
    with clock.installed():
        timed = drive(SuffixProposer(4))
    assert timed == untimed  # timing changes nothing
    assert suffix_tree.SuffixIndex.lookup is lookup  # restored
    assert len(clock.seconds["prompt"]) == 3 and len(clock.seconds["forget"]) == 3
    assert len(clock.steps) == 3 * 6
    report = clock.report(3)
    assert set(report["us_per_request"]) == set(PARTS)
    assert set(STEP_PARTS) <= set(report["step_parts_us"])
    assert report["us_per_request"]["forget"] > 0 and report["us_per_request"]["evict"] == 0
    s = report["step_us"]
    assert 0 < s["median"] <= s["p99"] <= s["max"]


def test_evictions_are_timed_apart_from_caching():
    from foretell.spec_decode.suffix import SuffixSettings

    proposer = SuffixProposer(4, SuffixSettings(max_cached_requests=1))
    clock = DrafterClock()
    with clock.installed():
        drive(proposer, num_requests=3)
    assert len(clock.seconds["evict"]) == 2  # each response after the first evicts the one before
    assert clock.report(3)["evictions"] == 2


def test_steps_only_times_whole_calls():
    clock = DrafterClock(steps_only=True)
    with clock.installed():
        drive(SuffixProposer(4))
    assert len(clock.steps) == 3 * 6 and len(clock.seconds["forget"]) == 3
    assert "prompt" not in clock.seconds and all(parts == {} for _, parts in clock.steps)
