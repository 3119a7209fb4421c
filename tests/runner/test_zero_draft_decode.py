"""A speculative engine's k = 0 steps decoded as plain decode steps (issue 28): under adaptive
speculation with adaptive_skip_catch_up, a step of plain decode rows whose next step drafts nothing
runs no drafter, so, queued ahead, it takes decode_ahead.py's path (DecodeAhead with
zero_drafts_only) instead of the padded verify step's.

Checked on the CPU (fp32, the eager padded step and eager plain decoding): the kind is in the
pipeline only with the skip on and steps queued ahead; it takes exactly the k = 0 batches whose
next step drafts nothing (not one that drafts, not a verify, not under fixed k); forced k = 0 runs
no padded step after the prefills, queues its steps ahead and gives plain greedy output, and seeded
sampled output equal to an engine without a drafter; choices that switch between 0 and drafting
give plain greedy output; a queued decode step is followed only while the choice stays 0; draft
probabilities kept for a sequence that then verifies nothing are dropped.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from fixtures.padded_step import PROMPTS, fp32_engine, padded_kind
from foretell import SamplingParams
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.runner.decode_ahead import DecodeAhead
from foretell.runner.host_step import HostStep
from foretell.runner.input_batch import build_input_batch
from foretell.runner.sequence_result import SequenceResult
from foretell.spec_decode.adaptive import AdaptiveDraftLength


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def adaptive_engine(qwen3_checkpoint, eagle3_head, mode: str = "on", skip: bool = True, k="auto"):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3,
            "adaptive": k == "auto", "adaptive_skip_catch_up": skip}
    if k != "auto":
        spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": k}
    return fp32_engine(qwen3_checkpoint, async_scheduling=mode, speculative_config=spec)


def zero_kind(llm) -> DecodeAhead | None:
    kinds = [kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, DecodeAhead)]
    assert len(kinds) <= 1
    return kinds[0] if kinds else None


def force_choices(monkeypatch, cycle: list[int]) -> None:
    choices = itertools.cycle(cycle)
    monkeypatch.setattr(AdaptiveDraftLength, "choose", lambda self, batch_size: next(choices))


def count_plain_launches(monkeypatch) -> list[int | None]:
    """num_next_drafts of every step DecodeAhead launched from host inputs."""
    launched = []
    launch = DecodeAhead.launch

    def counted(self, sched, batch):
        step = launch(self, sched, batch)
        if step is not None:
            launched.append(sched.num_next_drafts)
        return step

    monkeypatch.setattr(DecodeAhead, "launch", counted)
    return launched


@pytest.fixture(scope="module")
def plain_greedy(qwen3_checkpoint) -> list[list[int]]:
    llm = fp32_engine(qwen3_checkpoint)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]


def test_the_kind_is_there_with_the_skip_and_steps_queued_ahead(qwen3_checkpoint, eagle3_head):
    llm = adaptive_engine(qwen3_checkpoint, eagle3_head)
    kind, verify = zero_kind(llm), padded_kind(llm)
    kinds = llm.engine.runner.pipeline.kinds
    assert kind is not None and kind.zero_drafts_only and kinds.index(kind) < kinds.index(verify)  # tried first
    assert kind.forget_draft_probs == llm.engine.runner.host_step.forget_draft_probs
    for mode, skip, k in (("off", True, "auto"), ("on", False, "auto"), ("on", True, 3)):
        llm = adaptive_engine(qwen3_checkpoint, eagle3_head, mode, skip, k)
        assert zero_kind(llm) is None and padded_kind(llm) is not None


def _sched(num_next_drafts, drafts=(), num_new=None, samples=True, params=None) -> SchedulerOutput:
    seq = Sequence(0, "r", 0, [1, 2, 3, 4], params or SamplingParams(temperature=0.0))
    seq.num_computed_tokens = 3
    item = ScheduledSequence(seq, num_new or 1 + len(drafts), list(drafts), samples)
    return SchedulerOutput([item], num_next_drafts=num_next_drafts)


def test_it_takes_k_zero_batches_whose_next_step_drafts_nothing():
    kind = DecodeAhead(None, None, None, 16, 4, 100, zero_drafts_only=True)
    plain = DecodeAhead(None, None, None, 16, 4, 100)
    assert kind.takes(_sched(0)) and plain.takes(_sched(0)) and plain.takes(_sched(None))
    assert not kind.takes(_sched(None))  # not adaptive (or before its start): the next step drafts K
    assert not kind.takes(_sched(2))  # the step must draft for the next one
    assert not kind.takes(_sched(0, drafts=[5]))  # a verify
    assert not kind.takes(_sched(0, num_new=2, samples=False))  # prefill rows
    assert not kind.takes(_sched(0, params=SamplingParams(structured_outputs={"regex": "a+"})))  # a grammar


def test_forced_k_zero_takes_no_padded_step_and_queues_ahead(qwen3_checkpoint, eagle3_head, plain_greedy,
                                                             monkeypatch):
    force_choices(monkeypatch, [0])
    llm = adaptive_engine(qwen3_checkpoint, eagle3_head)
    launched = count_plain_launches(monkeypatch)
    verified = padded_kind(llm).num_steps
    pipeline = llm.engine.runner.pipeline
    used, steps = pipeline.num_used, llm.get_stats()["num_steps"]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]
    assert got == plain_greedy
    assert padded_kind(llm).num_steps == verified  # no padded step: every k = 0 step decoded plainly
    assert launched and set(launched) == {0}
    steps = llm.get_stats()["num_steps"] - steps
    assert pipeline.num_used - used >= steps - len(launched) - 6 > 10  # but prefills, launches and the ends
    stats = llm.get_stats()
    assert stats["num_drafts"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_forced_k_zero_samples_as_an_engine_without_a_drafter(qwen3_checkpoint, eagle3_head, monkeypatch):
    """Seeded sampled requests (one with a penalty, one with logprobs): the tokens an engine
    without a drafter draws, queued ahead the same way."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0.7, seed=7, max_tokens=16, ignore_eos=True, logprobs=2),
              greedy(16)]
    plain = fp32_engine(qwen3_checkpoint, async_scheduling="on").generate(PROMPTS, params, use_tqdm=False)
    force_choices(monkeypatch, [0])
    llm = adaptive_engine(qwen3_checkpoint, eagle3_head)
    verified = padded_kind(llm).num_steps
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    ours, theirs = got[2].outputs[0].logprobs, plain[2].outputs[0].logprobs
    assert len(ours) == len(theirs) == 16
    for a, b in zip(ours, theirs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5 and a.top.keys() == b.top.keys()
    assert padded_kind(llm).num_steps == verified


@pytest.mark.parametrize("cycle", [[0, 0, 0, 2, 0, 0, 3, 3, 0, 1], [0, 3], [2, 0, 0, 0, 0, 0, 1]])
def test_switches_between_zero_and_drafting_give_plain_output(qwen3_checkpoint, eagle3_head, plain_greedy,
                                                             monkeypatch, cycle):
    force_choices(monkeypatch, cycle)
    llm = adaptive_engine(qwen3_checkpoint, eagle3_head)
    launched = count_plain_launches(monkeypatch)
    verified = padded_kind(llm).num_steps
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]
    assert got == plain_greedy
    assert padded_kind(llm).num_steps > verified and llm.get_stats()["num_drafts"] > 0  # drafting steps verified
    if cycle.count(0) > 1:
        assert launched and set(launched) == {0}
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_a_queued_step_follows_only_while_the_choice_stays_zero():
    """A plain decode step of zero_drafts_only queues the step after it for a choice of 0 only (a
    choice to draft, or none made, goes back to the padded verify step); plain decoding's own kind
    queues it whatever the choice."""
    forwards = []

    def forward(batch):  # logits [rows, 16] that pick token 5
        forwards.append(batch.num_seqs)
        return None, None, torch.nn.functional.one_hot(torch.full((batch.num_seqs,), 5), 16).float()

    for zero_only in (True, False):
        kind = DecodeAhead(None, forward, None, 16, 4, 100, zero_drafts_only=zero_only)
        sched = _sched(0)
        sched.scheduled[0].seq.block_ids = [0, 1]
        step = kind.launch(sched, build_input_batch(sched.scheduled, 4, torch.device("cpu")))
        assert step is not None and step.read(None)[0].new_token_ids == [5]
        for choice in (2, None):
            assert (step.launch_next(choice) is None) is zero_only
        following = step.launch_next(0)
        assert following is not None and following.positions == [4]


def test_forget_draft_probs():
    host = HostStep(None, None, None, 16, 4, 100, torch.device("cpu"))
    items = [_sched(0).scheduled[0]]
    host.forget_draft_probs(items)  # nothing kept: nothing to do
    host.draft_probs = {0: torch.zeros(2, 16), 9: torch.zeros(2, 16)}
    host.forget_draft_probs(items)
    assert list(host.draft_probs) == [9]
    kind = DecodeAhead(None, None, None, 16, 4, 100, zero_drafts_only=True, forget_draft_probs=host.forget_draft_probs)
    assert kind.launch(_sched(3), None) is None and list(host.draft_probs) == [9]  # declined: nothing dropped


def test_a_step_whose_drafts_were_cut_forgets_their_probabilities():
    """Drafts proposed for a step and cut to none before it ran (no verify): the probabilities kept
    for them are dropped with the step, not handed to the sequence's next, different drafts."""
    host = HostStep(None, None, None, 16, 4, 100, torch.device("cpu"))
    sched = _sched(0)
    host.draft_probs = {sched.scheduled[0].seq.seq_id: torch.zeros(2, 16)}
    batch = SimpleNamespace(sampling_seq_index=[0])
    results = [SequenceResult()]
    host.sample_greedy(sched, batch, torch.tensor([5]), results)
    assert results[0].new_token_ids == [5] and not host.draft_probs
