"""Suffix decoding's acceptance gate (spec_decode/suffix.py, suffix_decoding_min_accepted_tokens):
a sequence whose drafts are not accepted stops drafting for a pause that doubles while its probes
fail, and drafts on as soon as one is accepted; the engine's greedy output stays plain greedy's
with the gate at any bar, also when paused steps are plain decode steps queued ahead on the
padded path (the GPU's pipeline, on the CPU's buffers)."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams
from foretell.runner.decode_ahead import DecodeAhead
from foretell.runner.graph_setup import StepGraphSetup
from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import FIRST_PAUSE, MAX_PAUSE, SuffixProposer, SuffixSettings

LOOP = [5, 6, 7, 8, 9]
assert FIRST_PAUSE == 4


def batch(history: list[int], max_model_len: int = 10_000) -> DraftBatch:
    return DraftBatch(start_positions=[len(history) - 2], num_valid_rows=[1], next_token_ids=[history[-1]],
                      samples=[True], token_ids=None, hidden_states=None, aux_hidden_states=[], block_table=None,
                      block_size=16, sampling_params=[None], sample_indices=[0], max_model_len=max_model_len,
                      histories=[history], seq_ids=[1])


def drive(proposer: SuffixProposer, history: list[int], truth, steps: int) -> list[int]:
    """Steps of one sequence: each step emits the draft's accepted prefix (against truth(history,
    draft), the target's next tokens) plus one token; returns each step's draft length."""
    lengths = []
    draft = proposer.propose(batch(history)).token_ids[0]
    for _ in range(steps):
        target = truth(history, draft)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        history += target[: accepted + 1]
        lengths.append(len(draft))
        draft = proposer.propose(batch(history)).token_ids[0]
    return lengths


def looping(history, draft):
    """The target repeats LOOP: every draft of the loop is right."""
    return [LOOP[(len(history) + i) % len(LOOP)] for i in range(len(draft) + 1)]


def contrary(history, draft):
    """Two tokens, every pair followed by both: the drafter always finds a match and drafts, and
    the target always says the other token first."""
    first = (3 - draft[0]) if draft else 1 + len(history) % 2
    return [first] + [1] * len(draft)


def gate(bar: float) -> SuffixProposer:
    return SuffixProposer(3, SuffixSettings(min_match_length=2, max_tree_depth=8, min_accepted_tokens=bar))


def test_failing_drafts_pause_and_the_pause_doubles():
    proposer = gate(1.0)
    history = [LOOP[i % len(LOOP)] for i in range(12)]  # the loop: the first draft is the loop's
    first = proposer.propose(batch(history)).token_ids[0]
    assert first == [LOOP[12 % 5], LOOP[13 % 5], LOOP[14 % 5]]
    # The target breaks away: the draft accepts 0 of 3 (< 1): no lookup, no draft for FIRST_PAUSE tokens.
    history += [99]
    state = proposer.states[1]
    assert proposer.propose(batch(history)).token_ids[0] == []
    assert state.resume_at == len(history) + FIRST_PAUSE and state.pause == 2 * FIRST_PAUSE
    assert not state.own_match.positions  # dropped: looked up again at the resume
    # Back in the loop while paused: the index takes the tokens, nothing is drafted.
    for _ in range(FIRST_PAUSE - 1):
        history.append(LOOP[len(history) % 5])
        assert proposer.propose(batch(history)).token_ids[0] == []
    history.append(LOOP[len(history) % 5])
    probe = proposer.propose(batch(history)).token_ids[0]  # the pause is over: a probe
    assert probe and len(proposer.states[1].index.tokens) == len(history)
    # The probe is accepted whole (3 >= 1): drafting goes on, the pause starts over.
    history += probe + [LOOP[(len(history) + len(probe)) % 5]]
    assert proposer.propose(batch(history)).token_ids[0]
    assert state.pause == FIRST_PAUSE and state.resume_at <= len(history)


def test_probes_that_keep_failing_back_off_to_the_longest_pause():
    history = [1, 1, 2, 2, 1, 2, 1, 1, 2, 2, 1, 2]  # every pair of {1, 2} occurs, followed by both
    lengths = drive(gate(1.0), list(history), contrary, 400)
    drafted = [i for i, n in enumerate(lengths) if n]
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]  # a failed draft, then its pause
    assert gaps[:6] == [1 + 4, 1 + 8, 1 + 16, 1 + 32, 1 + MAX_PAUSE, 1 + MAX_PAUSE]
    assert len(drafted) < 15  # of 400 steps
    # The gate off: every step drafts, and fails.
    assert all(drive(gate(0.0), list(history), contrary, 50))


def test_accepted_drafts_never_pause():
    proposer = gate(2.0)
    history = [LOOP[i % len(LOOP)] for i in range(12)]
    lengths = drive(proposer, history, looping, 40)
    assert all(n == 3 for n in lengths)
    assert proposer.states[1].resume_at == 0


def test_bad_bar():
    from foretell.config import SpeculativeConfig

    for bar in (4, -1, True, "1"):
        with pytest.raises(ValueError, match="suffix_decoding_min_accepted_tokens"):
            SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_min_accepted_tokens=bar)
    assert SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                             suffix_decoding_min_accepted_tokens=0).suffix_decoding_min_accepted_tokens == 0


PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "a b a b a b",
           "def add(x):\n    return x + 1\ndef add(x):\n    return", "Question: what is 3 plus 7? Answer:"]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("bar", [0.0, 1.0, 3.0])
def test_greedy_equals_plain_with_the_gate_on_the_gpu_pipeline(qwen3_checkpoint, plain, monkeypatch, bar):
    """The padded path (the target's buffers uncaptured, the GPU's verify lengths) with steps queued
    ahead: paused sequences' steps are plain decode steps (DecodeAhead), the others verify."""
    built = StepGraphSetup.padded_forward

    def padded_forward(self, target):
        forward = built(self, target)
        if forward is None and target is None and self.proposer is not None:
            return self.graph_runner(capture_graphs=False, reads_host_lengths=True)
        return forward

    monkeypatch.setattr(StepGraphSetup, "padded_forward", padded_forward)
    spec = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 6,
            "suffix_decoding_min_match_length": 2, "suffix_decoding_min_accepted_tokens": bar}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec, async_scheduling="on")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == plain
    pipeline = llm.engine.runner.pipeline
    assert isinstance(pipeline.kinds[0], DecodeAhead) and pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
