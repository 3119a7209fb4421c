"""The suffix drafter's quiet steps (SuffixProposer.propose_step through host_drafts.propose_from_tokens:
no DraftBatch, no observe, no bar worked out on a step where nobody can draft) against the same
drafter driven through propose() on every step (the reference, the path before quiet steps).

A simulated engine (no model): each request's target output is a fixed token stream; a step
verifies the drafts proposed for it (accepted: the prefix the stream agrees with), emits the
accepted drafts and the stream's next token, and both drafters propose from the same scheduled
sequences. Checked, over fresh (nothing ever repeats), repetitive and mixed streams, batches with
requests joining and finishing (the global cache filled by forget), chunked prefills, under the gate
off, a fixed bar and the "auto" bar (drafting cheap, and dear enough that the learned bar looks
nothing up, the H200's GSM8K case):
  - the same drafts every step, the same sequence states (tokens seen, matches, pauses) and the
    same gate costs and bar (StepCostBar.as_dict), quiet steps taken where nobody drafts;
  - SuffixIndex.append_if_unmatched against extend() and a lookup's key test;
  - StepCostBar.quiet_step against begin_step / end_step(False) (the plain medians settled late
    give the same bars);
  - a sequence whose tokens do not continue what its state saw goes to the general path.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.runner import host_drafts
from foretell.runner.host_drafts import propose_from_tokens, token_draft_batch
from foretell.runner.sequence_result import SequenceResult
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_gate import StepCostBar
from foretell.spec_decode.suffix_tree import SuffixIndex

BLOCK_SIZE, MAX_MODEL_LEN = 16, 1 << 20


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeSeq:
    """What token_draft_batch and propose_step read of a Sequence."""

    def __init__(self, seq_id: int, prompt: list[int]):
        self.seq_id = seq_id
        self.index = seq_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.sampling_params = SimpleNamespace(structured_outputs=None)


def stream(kind: str, rng: random.Random, length: int, vocab: int = 1 << 20) -> list[int]:
    """A target output: fresh (no gram repeats), repetitive (a short loop, sometimes broken) or
    mixed (fresh runs and copies of earlier runs: text that quotes itself)."""
    if kind == "fresh":
        return [rng.randrange(vocab) for _ in range(length)]
    if kind == "repetitive":
        loop = [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]
        out = []
        while len(out) < length:
            out.extend(loop)
            if rng.random() < 0.3:
                out.append(rng.randrange(vocab))
        return out[:length]
    out = []
    while len(out) < length:
        if out and rng.random() < 0.4:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randint(4, 12)])
        else:
            out.extend(rng.randrange(vocab) for _ in range(rng.randint(4, 20)))
    return out[:length]


def make_proposer(gate, k: int) -> SuffixProposer:
    settings = SuffixSettings(max_tree_depth=12, min_match_length=3, min_accepted_tokens=gate)
    proposer = SuffixProposer(k, settings)
    if proposer.cost_bar is not None:
        proposer.cost_bar.clock = FakeClock()
    return proposer


def simulate(kind: str, gate, draft_cost: float, seed: int, k: int = 3, num_requests: int = 7,
             batch: int = 3, length: int = 90) -> dict:
    """Both drafters over the same requests; asserts the same drafts each step. Returns the
    drafters and how many of the candidate's steps were quiet."""
    rng = random.Random(seed)
    reference, candidate = make_proposer(gate, k), make_proposer(gate, k)
    requests = []
    for i in range(num_requests):
        output = stream(kind, rng, length)
        prompt = stream(kind, rng, rng.randint(2, 20)) + (output[: rng.randint(0, 15)] if kind != "fresh" else [])
        requests.append((FakeSeq(100 + i, prompt), output))
    waiting, running = list(requests), []
    drafts: dict[int, list[int]] = {}
    steps = quiet = 0
    while waiting or running:
        while waiting and len(running) < batch:
            running.append(waiting.pop(0))
        items, emitted = [], []
        for seq, output in running:
            done = len(seq.token_ids) - seq.num_prompt_tokens
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # a prefill chunk (samples at the prompt's end)
                chunk = min(seq.num_prompt_tokens - seq.num_computed_tokens, rng.choice([4, 50]))
                samples = seq.num_computed_tokens + chunk == seq.num_prompt_tokens
                items.append(ScheduledSequence(seq, chunk, [], samples))
                emitted.append(([output[0]] if samples else [], 0))
                continue
            draft = drafts.get(seq.seq_id, [])
            accepted = 0
            while accepted < len(draft) and done + accepted < len(output) - 1 and draft[accepted] == output[done + accepted]:
                accepted += 1
            items.append(ScheduledSequence(seq, 1 + len(draft), draft, True))
            emitted.append((output[done : done + accepted + 1], accepted))
        sched = SchedulerOutput(items)
        ref_results = [SequenceResult(list(new), accepted) for new, accepted in emitted]
        cand_results = [SequenceResult(list(new), accepted) for new, accepted in emitted]
        ref_drafts = reference.propose(token_draft_batch(sched, ref_results, BLOCK_SIZE, MAX_MODEL_LEN)).token_ids
        built = []
        original = host_drafts.token_draft_batch
        host_drafts.token_draft_batch = lambda *args: built.append(1) or original(*args)
        try:
            propose_from_tokens(candidate, sched, cand_results, BLOCK_SIZE, MAX_MODEL_LEN)
        finally:
            host_drafts.token_draft_batch = original
        assert [r.next_drafts for r in cand_results] == ref_drafts, f"step {steps}"
        steps += 1
        quiet += not built
        for proposer in (reference, candidate):  # the step's time, by what it verifies next
            if proposer.cost_bar is not None:
                proposer.cost_bar.clock.now += draft_cost if any(ref_drafts) else 1.0
        for item, (new, _), next_drafts in zip(items, emitted, ref_drafts):  # the scheduler's postprocess
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + (len(new) - 1 if new else 0)
            seq.token_ids.extend(new)
            drafts[seq.seq_id] = next_drafts
        for request in list(running):
            seq, output = request
            if len(seq.token_ids) - seq.num_prompt_tokens >= len(output):
                running.remove(request)
                reference.forget(seq.seq_id)
                candidate.forget(seq.seq_id)
        assert_same_states(reference, candidate)
    return {"reference": reference, "candidate": candidate, "steps": steps, "quiet": quiet}


def assert_same_states(reference: SuffixProposer, candidate: SuffixProposer) -> None:
    assert reference.states.keys() == candidate.states.keys()
    dormant = candidate.skips.histories  # a dormant batch's sequences catch up later (suffix_skips.py)
    for key, ref in reference.states.items():
        cand = candidate.states[key]
        if key in dormant:
            assert dormant[key][: cand.num_seen] == cand.tokens  # what it saw, then its sequence's tokens
            assert ref.tokens == dormant[key]
        else:
            assert cand.tokens == ref.tokens  # every token seen (indexed or pending)
        for name in ("prompt_length", "last_draft", "last_match_length", "run_going", "accepted_average",
                     "resume_at", "pause"):
            assert getattr(cand, name) == getattr(ref, name), name
        if ref.own_match.positions or cand.own_match.positions:  # a held match (no quiet step has one)
            assert (cand.own_match.length, cand.own_match.positions) == (ref.own_match.length, ref.own_match.positions)
    assert candidate.cache.index.tokens == reference.cache.index.tokens
    assert candidate.stats() == reference.stats()


GATES = {  # gate, a drafting step's cost in plain steps
    "off": (0.0, 1.0),
    "fixed": (1.0, 1.0),
    "auto-cheap": ("auto", 1.3),
    "auto-mid": ("auto", 3.0),  # a bar near 2: batches whose drafts together cannot pay draft nothing
    "auto-dear": ("auto", 9.0),  # the learned bar is k + 1: nothing is looked up (the H200's GSM8K)
}


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("kind", ["fresh", "repetitive", "mixed"])
def test_quiet_steps_draft_as_propose_does(gate, kind):
    bar, draft_cost = GATES[gate]
    for seed in range(3):
        run = simulate(kind, bar, draft_cost, seed)
        assert run["quiet"] > 0  # the quiet path is taken
        if kind == "fresh":  # nobody ever matches: every step after the prefills is quiet
            assert run["quiet"] >= run["steps"] - 20
    if gate == "auto-dear":
        gate_stats = run["candidate"].stats()["suffix_gate"]
        assert gate_stats["bar"] >= 3 or kind == "fresh"  # learned: nothing can pay


def test_quiet_steps_with_one_sequence_and_long_requests():
    # batch 1, long outputs: the gate's steady chains (plain intervals timed on quiet steps)
    for kind in ("fresh", "mixed"):
        run = simulate(kind, "auto", 2.0, seed=5, num_requests=3, batch=1, length=300)
        assert run["quiet"] > run["steps"] // 3


@pytest.mark.parametrize("kind", ["repetitive", "mixed"])
def test_dormant_batches_skip_runs_that_grow(monkeypatch, kind):
    """Under a learned bar of k or more the skipped calls leave the batch dormant (nothing stored
    per sequence; suffix_skips.py): most calls take that path, the runs grow to MAX_SKIPPED_RUN, and
    the drafts, states (caught up) and gate costs are propose()'s at every step."""
    from foretell.spec_decode.suffix_skips import MAX_SKIPPED_RUN, SkippedCalls

    dormant_calls = []
    original = SkippedCalls.skips
    monkeypatch.setattr(SkippedCalls, "skips",
                        lambda self, items: original(self, items) and not dormant_calls.append(1))
    run = simulate(kind, "auto", 9.0, seed=2, num_requests=3, batch=2, length=700)
    assert run["candidate"].stats()["suffix_gate"]["bar"] >= 3
    assert len(dormant_calls) > 0.7 * run["steps"]
    assert run["candidate"].skips.next_run == MAX_SKIPPED_RUN


def test_a_sequence_that_does_not_continue_its_state_takes_the_general_path():
    proposer, reference = make_proposer(0.0, 3), make_proposer(0.0, 3)
    rng = random.Random(1)
    seq = FakeSeq(7, stream("fresh", rng, 12))
    seq.num_computed_tokens = len(seq.token_ids)
    for step in range(6):
        new = [rng.randrange(1 << 20)]
        if step == 4:  # the sequence's tokens rewritten (recomputed elsewhere) under the same id
            seq.token_ids[-1] = seq.token_ids[-1] + 1
        item = ScheduledSequence(seq, 1, [], True)
        sched = SchedulerOutput([item])
        results = [SequenceResult(list(new))]
        expected = reference.propose(token_draft_batch(sched, [SequenceResult(list(new))], BLOCK_SIZE, MAX_MODEL_LEN))
        drafts = proposer.propose_step(sched.scheduled, results, lambda: token_draft_batch(
            sched, results, BLOCK_SIZE, MAX_MODEL_LEN))
        assert (drafts or [[]]) == expected.token_ids
        seq.token_ids.extend(new)
        assert proposer.states[7].tokens == reference.states[7].tokens == seq.token_ids


def test_propose_step_answers_none_only_for_quiet_steps():
    proposer = make_proposer(0.0, 3)
    seq = FakeSeq(1, [5, 6, 7, 8, 9])
    calls = []

    def make(sched, results):
        return lambda: calls.append(1) or token_draft_batch(sched, results, BLOCK_SIZE, MAX_MODEL_LEN)

    sched = SchedulerOutput([ScheduledSequence(seq, 5, [], True)])  # the prefill: a new state
    results = [SequenceResult([10])]
    assert proposer.propose_step(sched.scheduled, results, make(sched, results)) == [[]]
    assert calls == [1]
    seq.token_ids.append(10)
    for token in (11, 12, 5, 6, 7):  # fresh grams, then the prompt's 5 6 7 again: a match at 7
        sched = SchedulerOutput([ScheduledSequence(seq, 1, [], True)])
        results = [SequenceResult([token])]
        out = proposer.propose_step(sched.scheduled, results, make(sched, results))
        seq.token_ids.append(token)
        if token != 7:
            assert out is None and len(calls) == 1  # quiet: no DraftBatch built
    assert out == [[8, 9, 10]] and len(calls) == 2  # the match drafts what followed 5 6 7


@pytest.mark.parametrize("key_length", [1, 2, 3])
def test_append_if_unmatched_matches_extend_and_a_lookup(key_length):
    rng = random.Random(key_length)
    for trial in range(20):
        vocab = rng.choice([2, 3, 50])
        other = SuffixIndex(key_length, 8)
        other.append_sequence([rng.randrange(vocab) for _ in range(rng.randint(0, 30))])
        plain, tested = SuffixIndex(key_length, 8), SuffixIndex(key_length, 8)
        for _ in range(60):
            token = rng.randrange(vocab)
            known = plain.tail_key is not None
            plain.extend([token])
            found = plain.tail_key in plain.head or plain.tail_key in other.head  # what observe's lookups test
            appended = tested.append_if_unmatched(token, other.head)
            assert appended == (known and not found)
            if not appended:
                tested.extend([token])
            assert (tested.tokens, tested.prev, tested.head, tested.tail_key) == (
                plain.tokens, plain.prev, plain.head, plain.tail_key)


def drive_eager_and_lazy(monkeypatch, stale_after: int, seed: int, steps: int, change_rate: float,
                         draft_rate, read_rate: float) -> tuple[StepCostBar, StepCostBar]:
    """One random run of steps through two gates on their own clocks: `eager` works the bar out at
    every call (begin_step), `lazy` only at drafting calls, a plain step being a quiet_step (stamped,
    timed later). The lazy gate's bar, explore and learned are checked at every drafting call, its
    as_dict (which times the waiting stamps) at a read_rate share of the steps, and with a read at
    every step its explore too."""
    import foretell.spec_decode.suffix_gate as gate_module

    monkeypatch.setattr(gate_module, "DRAFT_STALE_AFTER", stale_after)  # staleness reached within the run
    rng = random.Random(seed)
    clocks = FakeClock(), FakeClock()
    eager, lazy = StepCostBar(4.0, clocks[0]), StepCostBar(4.0, clocks[1])
    ids = [1]
    for step in range(steps):
        if rng.random() < change_rate:
            ids = [rng.randrange(5) for _ in range(rng.choice([1, 2, 5]))]  # the batch changes
        wants_draft = rng.random() < draft_rate(step)
        bar = eager.begin_step(ids, [True] * len(ids))
        drafted = wants_draft and not eager.explore
        eager.end_step(drafted)
        if drafted:
            assert lazy.begin_step(ids, [True] * len(ids)) == bar
            assert lazy.explore == eager.explore and lazy.learned == eager.learned
            lazy.end_step(True)
        else:  # a step the drafter knew to be plain: timed, no bar worked out
            lazy.quiet_step(tuple(ids))
        if rng.random() < read_rate:
            assert lazy.as_dict() == eager.as_dict()
            assert lazy.explore == eager.explore or read_rate < 1.0  # (set again by the timing read)
        seconds = rng.uniform(1.5, 3.0) if drafted else rng.uniform(0.9, 1.1)
        for clock in clocks:
            clock.now += seconds
    return eager, lazy


def test_quiet_step_times_as_begin_step_does(monkeypatch):
    drive_eager_and_lazy(monkeypatch, 40, 3, 600, 0.02, lambda step: 0.3, read_rate=1.0)


def test_quiet_step_stamps_timed_late_give_the_same_costs(monkeypatch):
    """Long runs of quiet steps (past MAX_DEFERRED) whose stamps wait: the costs, the bar and the
    explorations read afterwards are those of timing every step at its call."""
    eager, lazy = drive_eager_and_lazy(monkeypatch, 300, 5, 3000, 0.005,
                                       lambda step: 0.5 if step % 400 < 100 else 0.01, read_rate=0.01)
    assert lazy.as_dict() == eager.as_dict()
    assert lazy.num_intervals == eager.num_intervals


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_barred_steps_only_where_the_bar_is_at_least_min_bar(monkeypatch, seed):
    """StepCostBar.barred_step says yes only on steps whose bar (worked out at each step, as
    begin_step does) is at least min_bar with no exploration; the costs and the bar read later
    are those of timing every step at its call. Drafting steps near the bar's edge (their cost
    drifts), plain steps of a noisy clock."""
    import foretell.spec_decode.suffix_gate as gate_module

    monkeypatch.setattr(gate_module, "DRAFT_STALE_AFTER", 500)
    rng = random.Random(seed)
    clocks = FakeClock(), FakeClock()
    eager, lazy = StepCostBar(4.0, clocks[0]), StepCostBar(4.0, clocks[1])
    ids, k, barred = [1], 3, 0
    for step in range(4000):
        if rng.random() < 0.003:
            ids = [rng.randrange(5) for _ in range(rng.choice([1, 2]))]
        bar = eager.begin_step(ids, [True] * len(ids))
        lookup = not eager.explore and not (eager.learned and bar >= k)
        drafted = lookup and rng.random() < 0.5
        eager.end_step(drafted)
        if lazy.barred_step(tuple(ids), k):
            barred += 1
            assert not lookup
        else:
            assert lazy.begin_step(ids, [True] * len(ids)) == bar
            assert lazy.explore == eager.explore and lazy.learned == eager.learned
            lazy.end_step(drafted)
        if rng.random() < 0.01:
            assert lazy.as_dict() == eager.as_dict()
        cost = 1.0 + 4.2 * (1 + 0.3 * ((step // 700) % 2))  # drafting near and far over the bar
        seconds = rng.uniform(cost - 0.4, cost + 0.4) if drafted else rng.uniform(0.8, 1.2)
        for clock in clocks:
            clock.now += seconds
    assert lazy.as_dict() == eager.as_dict()
    assert barred > 500
