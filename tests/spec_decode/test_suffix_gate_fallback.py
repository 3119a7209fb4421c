"""The "auto" acceptance gate charges a drafting step its whole cost (spec_decode/suffix_gate.py):
where plain steps are queued ahead (a GPU), the step after a run of drafting steps falls back (it
is not queued ahead), so a run of m drafting intervals D costs m D plus the fallback F, against
m + 1 plain steps P. On a fake engine clock (a call's interval lasts D when it drafted, F when the
call before it drafted, else P) the bar is held to the break-even worked out per run here; in the
drafter, drafts that accept too few tokens to pay for D + F - P stop, drafts that pay go on."""

from __future__ import annotations

import pytest

from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_gate import (
    COST_WINDOW, DRAFT_STALE_AFTER, EXPLORE_INTERVAL, EXPLORE_STEPS, MIN_COST_SAMPLES, StepCostBar,
)
from tests.spec_decode.test_suffix_lazy_index import make_batch

MS = 1e-3


class EngineClock:
    """Time as the engine's steps make it: the interval after a call that drafted lasts D (the
    proposal and the verify), after one that did not but whose call before drafted F (the step
    that falls back from the verify), else P (a plain step queued ahead)."""

    def __init__(self, draft_s: float, fallback_s: float, plain_s: float):
        self.draft_s, self.fallback_s, self.plain_s = draft_s, fallback_s, plain_s
        self.now = 0.0
        self.last_drafted = False

    def __call__(self) -> float:
        return self.now

    def step(self, drafted: bool) -> None:
        self.now += self.draft_s if drafted else self.fallback_s if self.last_drafted else self.plain_s
        self.last_drafted = drafted


def run(pattern, clock: EngineClock, bar: StepCostBar | None = None,
        seq_ids=(1,)) -> tuple[StepCostBar, list[bool]]:
    """One begin/end per entry of pattern (whether the step would draft; the gate's exploration
    overrides it); returns the bar and what each step drafted."""
    bar = bar or StepCostBar(17.0, clock)
    drafted_steps = []
    for wants in pattern:
        bar.begin_step(list(seq_ids), [True] * len(seq_ids))
        drafted = wants and not bar.explore
        bar.end_step(drafted)
        clock.step(drafted)
        drafted_steps.append(drafted)
    bar.begin_step(list(seq_ids), [True] * len(seq_ids))  # closes the last interval
    return bar, drafted_steps


def runs_of(drafted: list[bool]) -> list[int]:
    """The lengths of the runs of drafting steps that a step without drafts ends."""
    lengths, current = [], 0
    for d in drafted:
        if d:
            current += 1
        elif current:
            lengths.append(current)
            current = 0
    return lengths


def break_even(runs: list[int], d: float, f: float, p: float) -> float:
    """The accepted tokens per draft at which runs of drafting steps pay: a run of m drafting steps
    and its fallback take m d + f and yield m (1 + a) + 1 tokens, against (m (1 + a) + 1) p for
    plain steps; summed over the runs, a = (sum (m d + f) - n p) / (sum m p) - 1."""
    spent = sum(m * d + f for m in runs) - len(runs) * p
    return spent / (sum(runs) * p) - 1


@pytest.mark.parametrize("d, f, p", [(3.0, 2.5, 1.0), (5.0, 1.0, 1.0), (1.3, 1.0, 1.0), (2.0, 4.0, 0.5)])
def test_a_run_of_one_is_charged_its_fallback(d, f, p):
    clock = EngineClock(d * MS, f * MS, p * MS)
    bar, _ = run([False] * 6 + [True, False, False] * 8, clock)
    expected = (d + f - p) / p - 1  # one drafting step and its fallback against two plain steps
    assert bar.bar == pytest.approx(max(expected, 0.1))
    assert break_even([1] * 8, d, f, p) == pytest.approx(expected)
    gate = bar.as_dict()
    assert gate["draft_step_ms"] == [pytest.approx(d + f - p, abs=1e-4)]
    assert gate["fallback_step_ms"] == [pytest.approx(f)] and gate["plain_step_ms"] == [pytest.approx(p)]
    assert gate["steps_per_fallback"] == [1.0]


def test_on_a_cpu_the_fallback_costs_a_plain_step_and_the_bar_is_unchanged():
    clock = EngineClock(1.5 * MS, 1.0 * MS, 1.0 * MS)  # nothing queued ahead: F = P
    bar, _ = run([False] * 6 + [True, True, False, False] * 6, clock)
    assert bar.bar == pytest.approx(0.5)


def test_longer_runs_share_their_fallback(monkeypatch):
    from foretell.spec_decode import suffix_gate

    window = 9
    monkeypatch.setattr(suffix_gate, "COST_WINDOW", window)  # (a window shorter than the runs)
    d, f, p = 2.0, 4.0, 1.0
    runs = [1, 3, 2, 5, 1, 4, 3, 2, 6, 1, 2]  # the window keeps the last `window` of them
    pattern = [False] * 6
    for m in runs:
        pattern += [True] * m + [False] * 2
    bar, drafted = run(pattern, EngineClock(d * MS, f * MS, p * MS))
    # (the second run is cut short by one step: the gate explores a fallback once it knows D and P)
    assert runs_of(drafted) == [1, 2] + runs[2:]
    expected = break_even(runs[-window:], d, f, p)
    assert bar.bar == pytest.approx(expected)
    assert bar.as_dict()["steps_per_fallback"] == [round(sum(runs[-window:]) / window, 2)]


def test_before_enough_fallbacks_a_drafting_step_costs_its_interval():
    d, f, p = 3.0, 2.5, 1.0
    clock = EngineClock(d * MS, f * MS, p * MS)
    bar, drafted = run([False] * 6 + [True, True, False, False] + [True, False, False], clock)
    assert runs_of(drafted) == [2, 1] and len(bar.buckets[1].fallback) == MIN_COST_SAMPLES - 1
    assert bar.bar == pytest.approx(d / p - 1)
    run([True, False, False], clock, bar)
    assert bar.bar == pytest.approx(break_even([2, 1, 1], d, f, p))


def test_a_fallback_after_a_batch_change_is_not_timed():
    clock = EngineClock(3 * MS, 9 * MS, 1 * MS)
    bar, _ = run([False] * 6 + [True, False, False] * MIN_COST_SAMPLES, clock)
    timed = list(bar.buckets[1].fallback)
    assert [m for _, m in timed] == [1] * MIN_COST_SAMPLES
    run([True] * 4, clock, bar)
    # the batch changes (a request joins) where the run ends: the interval is not steady
    run([False] * 4, clock, bar, seq_ids=(1, 2))
    assert list(bar.buckets[1].fallback) == timed and not bar.buckets[2].fallback
    # a chain that starts drafting: its run counts from the chain's first call
    bar.begin_step([1], [True])
    bar.end_step(True)
    clock.step(True)
    run([True, False, False], clock, bar)
    assert list(bar.buckets[1].fallback) == timed + [(pytest.approx(9 * MS), 2)]


def test_a_batch_that_always_drafts_explores_its_fallbacks():
    d, f, p = 2.0, 5.0, 1.0
    bar, drafted = run([True] * (3 * EXPLORE_INTERVAL + 20), EngineClock(d * MS, f * MS, p * MS))
    # first EXPLORE_STEPS steps without drafts (a fallback, then plain steps), then one step each
    # EXPLORE_INTERVAL drafting steps until MIN_COST_SAMPLES fallbacks are timed
    gaps = [i for i, x in enumerate(drafted) if not x]
    first = MIN_COST_SAMPLES
    assert gaps[:EXPLORE_STEPS] == list(range(first, first + EXPLORE_STEPS))
    assert len(gaps) == EXPLORE_STEPS + MIN_COST_SAMPLES - 1
    assert [b - a - 1 for a, b in zip(gaps[EXPLORE_STEPS - 1:], gaps[EXPLORE_STEPS:])] == [EXPLORE_INTERVAL] * 2
    assert bar.bar == pytest.approx(break_even(runs_of(drafted), d, f, p))


def test_a_stale_drafting_cost_drops_its_fallbacks():
    clock = EngineClock(3 * MS, 2.5 * MS, 1 * MS)
    bar, _ = run([False] * 6 + [True, False, False] * 4, clock)
    assert bar.buckets[1].fallback_s is not None
    run([False] * (DRAFT_STALE_AFTER + 2), clock, bar)
    costs = bar.buckets[1]
    assert costs.draft_s is None and costs.fallback_s is None and not costs.fallback and costs.run_length == 1.0


# ---- in the drafter --------------------------------------------------------------------------

LOOP = [5, 6, 7, 8, 9]


def drive(accepted: int, clock: EngineClock, steps: int = 300,
          bar="auto") -> tuple[SuffixProposer, list[int], int]:
    """One sequence whose drafts come every third step: the target takes `accepted` tokens of a
    draft, then says a token never seen, so the next two steps have no match (a fallback and a
    plain step); without a draft it goes on with LOOP. Returns the drafter, each step's draft
    length and the tokens made."""
    proposer = SuffixProposer(8, SuffixSettings(min_match_length=2, max_tree_depth=16, max_spec_factor=4.0,
                                                min_accepted_tokens=bar))
    if proposer.cost_bar is not None:
        proposer.cost_bar.clock = clock
    history, fresh, lengths = LOOP * 4, 1000, []
    for _ in range(steps):
        draft = proposer.propose(make_batch([history], [1], [True], 8)).token_ids[0]
        clock.step(bool(draft))
        lengths.append(len(draft))
        if draft:
            history = history + draft[:accepted] + [fresh]
            fresh += 1
        else:
            last = next(t for t in reversed(history) if t in LOOP)
            history = history + [LOOP[(LOOP.index(last) + 1) % len(LOOP)]]
    return proposer, lengths, len(history) - len(LOOP) * 4


def test_the_gate_stops_drafts_that_do_not_pay_for_their_fallback():
    d, f, p = 3.0, 3.0, 1.0  # without the fallback the bar would be d / p - 1 = 2
    proposer, lengths, tokens = drive(3, EngineClock(d * MS, f * MS, p * MS))
    assert proposer.break_even == pytest.approx((d + f - p) / p - 1)  # 4 > 3 accepted
    assert proposer.bar >= proposer.break_even  # (plus the margin its losing drafts realised)
    clock = proposer.cost_bar.clock
    assert sum(1 for n in lengths if n) < 15  # of 300 steps: learning, then the paused sequence's probes
    # the gate off drafts every third step and loses against plain steps (one token per p)
    off_clock = EngineClock(d * MS, f * MS, p * MS)
    _, off_lengths, off_tokens = drive(3, off_clock, bar=0.0)
    assert sum(1 for n in off_lengths if n) == 100
    assert off_tokens / off_clock.now < 0.9 / (p * MS) < tokens / clock.now


def test_the_gate_keeps_drafts_that_pay_for_their_fallback():
    d, f, p = 3.0, 3.0, 1.0
    clock = EngineClock(d * MS, f * MS, p * MS)
    proposer, lengths, tokens = drive(6, clock)
    assert proposer.bar == pytest.approx(4.0)
    _, off_lengths, _ = drive(6, EngineClock(d * MS, f * MS, p * MS), bar=0.0)
    assert sum(1 for n in off_lengths if n) == 100
    assert sum(1 for n in lengths if n) >= 98  # (the gate's exploration: a step without a draft times a fallback)
    assert tokens / clock.now > 1.2 / (p * MS)
