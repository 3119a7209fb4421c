"""Suffix decoding's cost-aware gate (suffix_decoding_min_accepted_tokens = "auto",
spec_decode/suffix_gate.py): the bar a sequence's drafts must accept on average follows what a
drafting step costs against a plain one on this machine, t_draft / t_plain - 1, learned from the
time between the drafter's calls. The policy is held to hand-computed bars on a fake clock (steady
and unsteady batches, buckets, exploration, clamps); in the drafter, drafts that cannot pay are not
proposed and a bar of k or more stops lookups; end to end on the CPU greedy output equals plain
greedy output and get_stats() shows the bar; config, CLI and hybrid."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from foretell import LLM, SamplingParams
from foretell.spec_decode.suffix import FIRST_PAUSE, MAX_PAUSE, SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_gate import (
    AUTO_PRIOR_BAR, COST_QUANTILE, COST_WINDOW, DRAFT_STALE_AFTER, EXPLORE_INTERVAL, EXPLORE_STEPS, MIN_AUTO_BAR,
    MIN_COST_SAMPLES, PAUSE_PER_BAR,
    StepCostBar, bucket_of,
)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(bar: StepCostBar, clock: FakeClock, pattern, draft_s: float, plain_s: float,
              seq_ids=(1,), samples=None) -> list[bool]:
    """One begin/end per entry of pattern (whether the drafter would draft this step); a step that
    drafts makes the interval to the next call last draft_s, else plain_s. The gate's exploration
    overrides pattern (no draft). Returns what was drafted."""
    drafted_steps = []
    for wants in pattern:
        bar.begin_step(list(seq_ids), list(samples) if samples is not None else [True] * len(seq_ids))
        drafted = wants and not bar.explore
        bar.end_step(drafted)
        drafted_steps.append(drafted)
        clock.now += draft_s if drafted else plain_s
    return drafted_steps


def costed(max_bar: float = 17.0) -> tuple[StepCostBar, FakeClock]:
    clock = FakeClock()
    return StepCostBar(max_bar, clock), clock


@pytest.mark.parametrize("ratio, expected", [(9.0, 8.0), (1.2, 0.2), (1.02, MIN_AUTO_BAR), (30.0, 17.0)])
def test_the_bar_is_the_break_even_of_the_timed_steps(ratio, expected):
    bar, clock = costed()
    assert bar.bar == AUTO_PRIOR_BAR
    # plain stretches and drafting stretches, as a gate pausing and probing makes them
    run_steps(bar, clock, [False] * 6 + [True] * 6 + [False] * 6 + [True] * 6, 1e-3 * ratio, 1e-3)
    bar.begin_step([1], [True])
    assert bar.bar == pytest.approx(expected)
    assert bar.as_dict()["bars"] == [pytest.approx(expected, abs=1e-4)]
    assert bar.as_dict()["draft_step_ms"] == [pytest.approx(ratio, abs=1e-4)]
    assert bar.as_dict()["plain_step_ms"] == [pytest.approx(1.0)]


def test_the_cost_is_a_low_quantile_of_the_recent_steps():
    bar, clock = costed()
    run_steps(bar, clock, [False] * 8, 0, 1e-3)
    for seconds in (5e-3, 50e-3, 3e-3, 6e-3, 4e-3):  # one slow outlier (a GC pause, a page fault)
        bar.begin_step([1], [True])
        bar.end_step(True)
        clock.now += seconds
    bar.begin_step([1], [True])
    # sorted 3, 4, 5, 6, 50: the floor(4 * COST_QUANTILE)-th smallest
    assert bar.buckets[1].draft_s == pytest.approx(sorted([5, 50, 3, 6, 4])[int(4 * COST_QUANTILE)] * 1e-3)
    assert bar.bar == pytest.approx(1e3 * bar.buckets[1].draft_s - 1.0)
    for _ in range(2 * COST_WINDOW):  # the machine got faster: the window forgets the old steps
        bar.end_step(True)
        clock.now += 2e-3
        bar.begin_step([1], [True])
    assert bar.bar == pytest.approx(1.0)


def test_only_steady_intervals_count():
    bar, clock = costed()
    # every call a new batch (requests joining, leaving, an idle gap between generate() calls)
    for i in range(10):
        bar.begin_step([i], [True])
        bar.end_step(i % 2 == 0)
        clock.now += 1.0
    # a prefill chunk in the batch every step
    run_steps(bar, clock, [True, False] * 5, 1.0, 1.0, seq_ids=(1, 2), samples=(True, False))
    # no seq_ids: nothing to tell one batch from another
    for _ in range(5):
        bar.begin_step(None, [True])
        bar.end_step(False)
    assert bar.buckets == {}
    # alternating: the plain step after a draft is the fallback from a verify, not a plain step
    run_steps(bar, clock, [True, False] * 3, 9e-3, 1e-3)
    assert len(bar.buckets[1].plain) == 0 and len(bar.buckets[1].draft) == 3  # closed by the even calls


def test_a_batch_that_always_drafts_explores_plain_steps():
    bar, clock = costed()
    drafted = run_steps(bar, clock, [True] * 40, 5e-3, 1e-3)
    # the drafting cost known after MIN_COST_SAMPLES intervals (the first call has no interval
    # before it): the next steady call explores EXPLORE_STEPS steps without drafts
    first = MIN_COST_SAMPLES  # the call that closes the third interval explores
    assert drafted[:first] == [True] * first
    assert drafted[first:first + EXPLORE_STEPS] == [False] * EXPLORE_STEPS
    assert all(drafted[first + EXPLORE_STEPS:])
    assert bar.bar == pytest.approx(4.0)
    assert drafted.count(False) == EXPLORE_STEPS  # learned: no more exploring


def test_exploring_again_only_after_an_interval():
    bar, clock = costed()
    run_steps(bar, clock, [True] * (MIN_COST_SAMPLES + 1), 5e-3, 1e-3)
    # the exploration is cut by batch changes: the plain cost stays unknown
    for i in range(EXPLORE_STEPS - 1):  # the last call above explored; these go on exploring
        bar.begin_step([100 + i], [True])
        assert bar.explore
        bar.end_step(False)
    drafted = run_steps(bar, clock, [True] * (EXPLORE_INTERVAL + EXPLORE_STEPS + 4), 5e-3, 1e-3)
    # no exploring before EXPLORE_INTERVAL more drafting intervals, then one that teaches it
    assert drafted[:EXPLORE_INTERVAL] == [True] * EXPLORE_INTERVAL
    assert False in drafted[EXPLORE_INTERVAL:]
    assert bar.bar == pytest.approx(4.0)


def test_buckets_by_batch_size_and_the_nearest_one_lends_its_bar():
    bar, clock = costed()
    run_steps(bar, clock, [False] * 5 + [True] * 5, 3e-3, 1e-3)  # batch 1: 3x
    run_steps(bar, clock, [False] * 5 + [True] * 5, 12e-3, 6e-3, seq_ids=range(8))  # batch 8: 2x
    assert bar.as_dict()["batch_sizes"] == [1, 8]
    assert bar.begin_step([1], [True]) == pytest.approx(2.0)
    assert bar.begin_step(list(range(8)), [True] * 8) == pytest.approx(1.0)
    assert bar.begin_step(list(range(11)), [True] * 11) == pytest.approx(1.0)  # bucket 8 (8..15)
    assert bar.begin_step(list(range(2)), [True] * 2) == pytest.approx(2.0)  # untimed: nearest (1)
    assert bar.begin_step(list(range(40)), [True] * 40) == pytest.approx(1.0)  # untimed: nearest (8)
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 4, 4, 8, 8, 16]


def test_a_drafting_cost_gone_stale_is_timed_again():
    bar, clock = costed(max_bar=4.0)
    run_steps(bar, clock, [False] * 5 + [True] * 5, 20e-3, 1e-3)  # a slow first measurement: bar 4 (k + 1)
    assert bar.begin_step([1], [True]) == 4.0 and bar.learned
    bar.end_step(False)
    drafted = run_steps(bar, clock, [False] * (DRAFT_STALE_AFTER + 1), 20e-3, 1e-3)  # drafting off meanwhile
    assert not any(drafted)
    assert bar.begin_step([1], [True]) == AUTO_PRIOR_BAR and not bar.learned  # stale: the prior drafts again
    bar.end_step(True)
    clock.now += 3e-3
    run_steps(bar, clock, [True] * 4, 3e-3, 1e-3)  # drafting is cheaper now
    assert bar.begin_step([1], [True]) == pytest.approx(2.0)


def test_the_warm_up_teaches_the_gate_nothing():
    proposer, clock = auto_proposer()
    teach(proposer, clock, ratio=5.0)
    assert proposer.stats()["suffix_gate"]["bars"] == [pytest.approx(4.0)]
    proposer.drop_cached_responses()  # what the engine's warm-up calls after its dummy requests
    assert proposer.stats()["suffix_gate"]["batch_sizes"] == [] and not proposer.cost_bar.learned
    assert proposer.cost_bar.clock is clock


def test_bad_max_bar():
    with pytest.raises(ValueError, match="max_bar"):
        StepCostBar(0.0)


# ---- in the drafter --------------------------------------------------------------------------

def auto_proposer(k: int = 8, **settings) -> tuple[SuffixProposer, FakeClock]:
    proposer = SuffixProposer(k, SuffixSettings(min_match_length=2, max_tree_depth=12, min_accepted_tokens="auto",
                                                **settings))
    clock = FakeClock()
    proposer.cost_bar.clock = clock
    return proposer, clock


def one(history: list[int], seq_id: int = 1):
    from tests.spec_decode.test_suffix_lazy_index import make_batch

    return make_batch([history], [seq_id], [True], 8)


def teach(proposer: SuffixProposer, clock: FakeClock, ratio: float) -> None:
    """Steps on a sequence of its own whose drafts cost ratio plain steps, until the bar is learned."""
    history = list(range(1000, 1400))  # never repeats: no drafts, plain steps
    for i in range(6):
        history.append(2000 + i)
        proposer.propose(one(history, seq_id=99))
        clock.now += 1e-3
    for _ in range(5):  # the cost of drafting steps, fed to the policy directly
        proposer.cost_bar.begin_step([99], [True])
        proposer.cost_bar.end_step(True)
        clock.now += ratio * 1e-3
    proposer.forget(99)


def test_a_draft_no_longer_than_the_bar_is_not_proposed():
    proposer, clock = auto_proposer()
    teach(proposer, clock, ratio=5.0)  # bar 4
    loop = [5, 6, 7, 8, 9]
    history = [loop[i % 5] for i in range(12)]  # a match of 12 tokens: drafts up to k = 8
    draft = proposer.propose(one(history)).token_ids[0]
    assert proposer.bar == pytest.approx(4.0) and len(draft) > 4 and draft == [loop[(12 + i) % 5] for i in range(len(draft))]
    short = [1, 2, 3, 1, 2]  # a match of 2 (< 4): drafts of at most 2 tokens cannot pay
    assert proposer.propose(one(short, seq_id=2)).token_ids[0] == []
    # the same with a fixed bar of 1: that draft is proposed
    fixed = SuffixProposer(8, SuffixSettings(min_match_length=2, max_tree_depth=12, min_accepted_tokens=1.0))
    assert fixed.propose(one(short, seq_id=2)).token_ids[0] == [3, 1]
    assert fixed.stats() == {"suffix_gate": {"auto": False, "bar": 1.0}}


def test_a_lookup_the_learned_bar_rejects_pauses_the_sequence():
    # A match too short to pay under the learned bar: the sequence stops looking up for its pause
    # (each lookup is host time on a step that stays plain), its tokens wait unindexed.
    proposer, clock = auto_proposer()
    teach(proposer, clock, ratio=5.0)  # bar 4
    history = [1, 2, 3, 1, 2]  # a match of 2: no draft of more than 4 tokens
    assert proposer.propose(one(history, seq_id=2)).token_ids[0] == []
    state = proposer.states[2]
    assert state.resume_at == len(history) + FIRST_PAUSE and state.pause == 2 * FIRST_PAUSE
    indexed = len(state.index.tokens)
    for token in [3, 1, 2]:  # within the pause: stored, not indexed, nothing drafted
        history.append(token)
        clock.now += 1e-3  # (plain steps as teach timed them: the bar stays)
        assert proposer.propose(one(history, seq_id=2)).token_ids[0] == []
    assert len(state.index.tokens) == indexed and state.pending == [3, 1, 2]
    # a fixed bar keeps looking up every step (no learned bar, no pause for a short match)
    fixed = SuffixProposer(8, SuffixSettings(min_match_length=2, max_tree_depth=12, min_accepted_tokens=1.0))
    fixed.propose(one([1, 2, 3, 1, 2], seq_id=2))
    assert fixed.states[2].resume_at == 0


def test_a_bar_of_k_or_more_looks_nothing_up_and_pauses_longer():
    proposer, clock = auto_proposer()
    teach(proposer, clock, ratio=12.0)  # bar 11, clamped to k + 1 = 9
    loop = [5, 6, 7, 8, 9]
    history = [loop[i % 5] for i in range(12)]
    assert proposer.propose(one(history)).token_ids[0] == []
    state = proposer.states[1]
    assert proposer.bar == pytest.approx(9.0)
    assert len(state.pending) == 12 and state.index.tokens == []  # stored, nothing indexed or looked up
    assert proposer.stats()["suffix_gate"]["bar"] == pytest.approx(9.0)
    # a failed probe's pause doubles up to PAUSE_PER_BAR x bar tokens, past MAX_PAUSE
    proposer.bar = 6.0
    state.last_draft, state.pause = [1] * 7, MAX_PAUSE
    proposer._judge(state, [2, 3], 14)
    assert state.pause == min(2 * MAX_PAUSE, int(PAUSE_PER_BAR * 6.0))


def test_lazy_and_eager_indexing_still_draft_the_same_under_auto():
    import random

    from tests.spec_decode.test_suffix_lazy_index import EagerSuffixProposer, random_workload, run_both

    rng = random.Random(3)
    workloads = [random_workload(rng, 4, rng.randrange(10, 40), rng.randrange(10, 40)) for _ in range(6)]
    settings = SuffixSettings(max_tree_depth=8, min_match_length=2, min_accepted_tokens="auto")

    # Each drafter on its own fake clock: a step after a call that drafted lasts 3 ms, else 1 ms
    # (bar 2), and from the 60th call on 20 ms (bar k + 1: no lookups at all).
    def clocked(cls):
        def make(k, s):
            proposer = cls(k, s)
            now, calls = [0.0], [0]

            def clock():
                calls[0] += 1
                now[0] += (20e-3 if calls[0] > 60 else 3e-3) if proposer.cost_bar._drafted else 1e-3
                return now[0]

            proposer.cost_bar.clock = clock
            return proposer
        return make

    num_drafts, num_pending = run_both(workloads, 2, settings, 6, 1000, seed=1,
                                       make_lazy=clocked(SuffixProposer), make_eager=clocked(EagerSuffixProposer))
    assert num_drafts > 0 and num_pending > 0


# ---- end to end, config, CLI -----------------------------------------------------------------

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "a b a b a b a b a b",
           "def add(x):\n    return x + 1\ndef add(x):\n    return", "Question: what is 3 plus 7? Answer:"]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_under_auto_and_the_bar_is_in_get_stats(qwen3_checkpoint, plain, batch):
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8,
            "suffix_decoding_min_match_length": 2}  # min_accepted_tokens: "auto", the default
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, max_num_seqs=batch, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == plain
    stats = llm.get_stats()
    gate = stats["suffix_gate"]
    assert gate["auto"] is True and MIN_AUTO_BAR <= gate["bar"] <= 4 + 1
    assert stats["num_drafts"] > 0
    assert gate["batch_sizes"] and all(b in (1, 2, 4) for b in gate["batch_sizes"])
    timed = [(d, p) for d, p in zip(gate["draft_step_ms"], gate["plain_step_ms"]) if d is not None and p is not None]
    for (d, p), bar in zip(timed, [b for b, d, p in zip(gate["bars"], gate["draft_step_ms"], gate["plain_step_ms"])
                                   if d is not None and p is not None]):
        assert bar == pytest.approx(min(max(d / p - 1, MIN_AUTO_BAR), 5.0), rel=1e-2, abs=1e-3)


def test_a_fixed_bar_still_works_and_shows_in_get_stats(qwen3_checkpoint, plain):
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_accepted_tokens": 1.5}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == plain
    assert llm.get_stats()["suffix_gate"] == {"auto": False, "bar": 1.5}


def test_other_drafters_add_no_gate_to_get_stats(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32, speculative_config={"method": "ngram"})
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert "suffix_gate" not in llm.get_stats()


def test_config_takes_auto_or_a_number():
    from foretell.config import SpeculativeConfig

    assert SpeculativeConfig(method="suffix").suffix_decoding_min_accepted_tokens == "auto"
    assert SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                             suffix_decoding_min_accepted_tokens=2).suffix_decoding_min_accepted_tokens == 2
    for bar in ("Auto", "fast", None, -0.5, 4, False):
        with pytest.raises(ValueError, match=r"suffix_decoding_min_accepted_tokens must be 'auto' or a number"):
            SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_min_accepted_tokens=bar)
    with pytest.raises(ValueError, match="min_accepted_tokens must be a number >= 0 or 'auto'"):
        SuffixProposer(3, SuffixSettings(min_accepted_tokens="sometimes"))


def test_cli_flag_takes_auto_or_a_number():
    from foretell.cli_args import add_engine_args, speculative_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    for text, value in (("auto", "auto"), ("2.5", 2.5), ("0", 0.0)):
        args = parser.parse_args(["--method", "suffix", "--suffix-decoding-min-accepted-tokens", text])
        assert speculative_config_from_args(args)["suffix_decoding_min_accepted_tokens"] == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--method", "suffix", "--suffix-decoding-min-accepted-tokens", "often"])


def test_hybrid_auto_is_the_fixed_prior():
    from foretell.config import SpeculativeConfig

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, hybrid="mtp")
    assert config.suffix_decoding_min_accepted_tokens == "auto"
    assert SuffixSettings.from_config(config).min_accepted_tokens == AUTO_PRIOR_BAR
    assert SuffixSettings.from_config(SpeculativeConfig(method="suffix", num_speculative_tokens=4)
                                      ).min_accepted_tokens == "auto"


def test_before_any_timing_auto_gates_as_the_fixed_prior_does():
    proposer, _ = auto_proposer(k=1)
    short = [1, 2, 3, 1, 2]  # a one-token draft: no longer than the prior bar, still proposed
    assert proposer.propose(one(short)).token_ids[0] == [3]
    assert proposer.bar == AUTO_PRIOR_BAR and not proposer.cost_bar.learned


def test_tensor_parallel_auto_is_the_fixed_prior():
    from foretell.config import SpeculativeConfig
    from foretell.distributed.tensor_parallel import TensorParallel

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    one_rank = SimpleNamespace(tensor_parallel=TensorParallel())
    two_ranks = SimpleNamespace(tensor_parallel=SimpleNamespace(rank=0, world_size=2))  # (no process group)
    assert SuffixProposer.from_config(config, None, one_rank).cost_bar is not None
    proposer = SuffixProposer.from_config(config, None, two_ranks)
    assert proposer.cost_bar is None and proposer.bar == AUTO_PRIOR_BAR


def test_a_batch_verifies_only_when_its_drafts_together_pay_for_every_sequence():
    """A verify step is the whole batch's: under a learned bar b a batch of n sequences drafts only
    when its drafts' expected accepted tokens reach n x b (one long draft does not make 3 other
    sequences wait for a verify), and then every draft goes out."""
    from tests.spec_decode.test_suffix_lazy_index import make_batch

    proposer, clock = auto_proposer()
    teach(proposer, clock, ratio=4.0)  # bar 3 (batch 1's, lent to the batch of 4)
    loop = [5, 6, 7, 8, 9]
    looping = [loop[i % 5] for i in range(12)]  # a draft of 7 tokens, expected to accept ~7
    fresh = [[100 * s + i for i in range(12)] for s in range(1, 4)]  # no match: nothing to draft
    lone = proposer.propose(make_batch([looping, *fresh], [1, 2, 3, 4], [True] * 4, 8)).token_ids
    assert proposer.bar == pytest.approx(3.0)
    assert lone == [[], [], [], []]  # 7 expected < 4 x 3
    assert proposer.states[1].last_draft == []  # nothing to judge next step
    assert proposer.skips.left > 0  # and the batch's next calls look nothing up (suffix_skips.py)
    together = proposer.propose(make_batch([looping] * 2 + [[s + 50 for s in looping]] * 2, [5, 6, 7, 8],
                                           [True] * 4, 8)).token_ids
    assert all(len(d) > 3 for d in together)  # about 4 x 7 expected >= 12: every draft goes out
    assert proposer.skips.left == 0
    alone = proposer.propose(make_batch([looping], [9], [True], 8)).token_ids
    assert len(alone[0]) > 3  # batch 1: the draft's own bar
