"""The slim per-step plan for tensor-parallel ranks (foretell/runner/step_plan.py).

- A decode step's pickled plan is the same size whether the sequence is 1,000 or 40,000 tokens
  long (the whole-Sequence pickle it replaced grows with the length).
- The rank's mirror Sequences equal the front's after every step, through prefill chunks, decode,
  drafts, preemption (a new block table, the sequence resent whole), n > 1 samples sharing one
  SamplingParams, prompt logprobs, a stop string trimming tokens, forget and re-send.
- In process, an engine whose every step goes through encode -> pickle -> apply on mirrors gives
  exactly the outputs of the plain engine (tokens, logprobs, prompt logprobs) under chunked
  prefill and preemption, plain and with EAGLE3 drafts: the plan carries everything the runner
  reads. (tests/distributed/test_tp_engine.py runs the same plans through real worker processes.)
- A rank that falls out of step fails loudly, naming the sequence.
"""

from __future__ import annotations

import pickle

import pytest

from foretell import LLM, SamplingParams
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.runner.step_plan import NewSequence, PlanEncoder, SequenceMirrors, StepPlan


def make_seq(seq_id: int, length: int, params: SamplingParams | None = None, block_size: int = 16) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, [(7 * i + 3) % 500 for i in range(length)],
                   params or SamplingParams(temperature=0.0), frozenset({2}))
    seq.num_computed_tokens = length
    seq.block_ids = list(range(1000 + seq_id * 5000, 1000 + seq_id * 5000 + -(-(length + 1) // block_size)))
    return seq


def decode(seq: Sequence, drafts: tuple[int, ...] = ()) -> ScheduledSequence:
    return ScheduledSequence(seq, 1 + len(drafts), list(drafts), True)


def send(encoder: PlanEncoder, mirrors: SequenceMirrors, sched: SchedulerOutput) -> tuple[SchedulerOutput, int]:
    """What one step costs on the wire (bytes) and what the rank rebuilds from it."""
    wire = pickle.dumps(encoder.encode(sched), protocol=pickle.HIGHEST_PROTOCOL)
    return mirrors.apply(pickle.loads(wire)), len(wire)


def assert_mirrors_equal(front: SchedulerOutput, rank: SchedulerOutput) -> None:
    assert len(front.scheduled) == len(rank.scheduled)
    for want, got in zip(front.scheduled, rank.scheduled):
        a, b = want.seq, got.seq
        assert (b.seq_id, b.request_id, b.index, b.prompt_token_ids, b.token_ids, b.num_computed_tokens,
                b.block_ids, b.sampling_params, b.eos_token_ids, len(b.prompt_logprobs)) == \
               (a.seq_id, a.request_id, a.index, a.prompt_token_ids, a.token_ids, a.num_computed_tokens,
                a.block_ids, a.sampling_params, a.eos_token_ids, len(a.prompt_logprobs))
        assert (got.num_new_tokens, got.draft_token_ids, got.samples, got.accept_limit, got.input_token_ids) == \
               (want.num_new_tokens, want.draft_token_ids, want.samples, want.accept_limit, want.input_token_ids)


# ------------------------------------------------------------------------------- size


def decode_plan_bytes(length: int, batch: int) -> tuple[int, int]:
    """(the slim plan's bytes, the whole-Sequence pickle's bytes) of a decode step of `batch`
    sequences `length` tokens long, after their first plan went out."""
    seqs = [make_seq(i, length) for i in range(batch)]
    encoder, mirrors = PlanEncoder(), SequenceMirrors()
    send(encoder, mirrors, SchedulerOutput([decode(s) for s in seqs]))  # the first plan: whole sequences
    for seq in seqs:  # the step's token and, every block_size tokens, a new block
        seq.token_ids.append(9)
        seq.block_ids.append(seq.block_ids[-1] + 1)
        seq.num_computed_tokens += 1
    sched = SchedulerOutput([decode(s, (4, 5, 6)) for s in seqs])
    whole = len(pickle.dumps(sched, protocol=pickle.HIGHEST_PROTOCOL))
    rebuilt, slim = send(encoder, mirrors, sched)
    assert_mirrors_equal(sched, rebuilt)
    return slim, whole


@pytest.mark.parametrize("batch", [1, 16])
def test_a_decode_plan_does_not_grow_with_sequence_length(batch):
    short_slim, short_whole = decode_plan_bytes(1_000, batch)
    long_slim, long_whole = decode_plan_bytes(40_000, batch)
    assert long_slim <= short_slim + 4 * batch  # an integer's pickle may take a byte or two more
    assert long_slim < 80 * batch + 100  # tens of bytes a sequence
    assert long_whole > short_whole + 39_000 * batch  # what it replaced: every token, every step


# ------------------------------------------------------------------ mirrors follow the front


def test_mirrors_follow_prefill_decode_preemption_and_stop_strings():
    params = SamplingParams(temperature=0.7, n=2, prompt_logprobs=1, seed=3)
    a = Sequence(0, "req", 0, list(range(40)), params, frozenset({2}))
    b = Sequence(1, "req", 1, list(range(40)), params, frozenset({2}))
    encoder, mirrors = PlanEncoder(), SequenceMirrors()

    def step(*items: ScheduledSequence) -> SchedulerOutput:
        sched = SchedulerOutput(list(items))
        rebuilt, _ = send(encoder, mirrors, sched)
        assert_mirrors_equal(sched, rebuilt)
        return rebuilt

    a.block_ids, b.block_ids = [3, 4], [5, 6]
    first = step(ScheduledSequence(a, 24, [], False), ScheduledSequence(b, 24, [], False))  # prefill chunks
    assert first.scheduled[0].seq.sampling_params is first.scheduled[1].seq.sampling_params  # sent once
    for seq in (a, b):
        seq.num_computed_tokens = 24
        seq.block_ids.append(seq.block_ids[-1] + 10)
        seq.prompt_logprobs.extend([None] * 23)
    step(ScheduledSequence(a, 16, [], True), ScheduledSequence(b, 16, [], True))
    for seq, token in ((a, 11), (b, 12)):
        seq.num_computed_tokens = 40
        seq.token_ids.append(token)
        seq.prompt_logprobs.extend([None] * 16)
    step(decode(a, (7, 8)), decode(b))
    a.token_ids += [7, 8, 13]
    a.num_computed_tokens = 43
    # b is preempted: blocks freed (a new list), recomputed from 0 with its tokens kept
    b.reset_for_recompute()
    encoder.forget(b.seq_id)
    mirrors.forget(b.seq_id)
    b.block_ids = [20, 21, 22]
    rebuilt = step(decode(a), ScheduledSequence(b, 41, [], True))
    assert rebuilt.scheduled[1].seq.token_ids == list(range(40)) + [12]
    # a block table replaced without a forget (a re-admission the encoder sees as a new list)
    a.block_ids = [30, 31, 32, 33]
    a.num_computed_tokens, a.token_ids = 44, a.token_ids + [14]
    step(decode(a))
    # a stop string trims the tokens (the sequence then finishes; a plan after it still agrees)
    del a.token_ids[-3:]
    step(decode(a))


def test_a_rank_out_of_step_fails_loudly():
    seq = make_seq(0, 20)
    encoder, mirrors = PlanEncoder(), SequenceMirrors()
    send(encoder, mirrors, SchedulerOutput([decode(seq)]))
    mirrors.forget(0)  # the rank dropped it, the front did not
    seq.token_ids.append(1)
    with pytest.raises(RuntimeError, match="plan names sequence 0, which this rank does not hold"):
        send(encoder, mirrors, SchedulerOutput([decode(seq)]))
    mirrors.apply(StepPlan([NewSequence(1, "r", 0, [1, 2, 3], SamplingParams(), frozenset())], []))
    stale = encoder.encode(SchedulerOutput([decode(seq)]))._replace(new=[])
    planned = stale.scheduled[0]._replace(seq_id=1)
    with pytest.raises(RuntimeError, match="sequence 1 holds 3 tokens on this rank, the front process 21"):
        mirrors.apply(StepPlan([], [planned]))


# ------------------------------------------------------- the engine through plans, in process


class PlannedRunner:
    """A one-device runner reached only through plans, as a rank is: encode, pickle, apply on
    mirrors, run; and after every step, the mirrors hold what the front holds."""

    def __init__(self, runner):
        self.runner = runner
        self.encoder, self.mirrors = PlanEncoder(), SequenceMirrors()
        self.num_plans = 0

    def execute(self, sched):
        rebuilt, _ = send(self.encoder, self.mirrors, sched)
        assert_mirrors_equal(sched, rebuilt)
        self.num_plans += 1
        return self.runner.execute(rebuilt)

    def forget(self, seq_id):
        self.encoder.forget(seq_id)
        self.mirrors.forget(seq_id)
        self.runner.forget(seq_id)

    def abandon_step(self, seq_ids):
        for seq_id in seq_ids:
            self.forget(seq_id)
        self.runner.abandon_step(seq_ids)

    def __getattr__(self, name):  # last_times, reset_pipeline, describe, shutdown, ...
        return getattr(self.runner, name)


PROMPTS = [[5, 17, 250, 3, 99, 41, 7, 8, 9, 10], [300, 12, 8, 8, 61, 2, 19, 77, 140, 33], [44, 45], [9] * 12]
STRESS = dict(max_num_batched_tokens=8, num_kv_blocks=9, block_size=4, enable_prefix_caching=True)


def outputs(llm: LLM, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(c.token_ids, [(lp.token_id, round(lp.logprob, 4)) for lp in c.logprobs or []],
             [(lp.token_id, round(lp.logprob, 4)) for lp in o.prompt_logprobs or [] if lp is not None])
            for o in outs for c in o.outputs]


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_the_engine_through_plans_equals_the_engine(qwen3_checkpoint, eagle3_head, draft):
    spec = None if draft is None else {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2}
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, seed=11, n=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)]
    plain = LLM(qwen3_checkpoint, dtype="float32", speculative_config=spec, **STRESS)
    expected = outputs(plain, params)
    llm = LLM(qwen3_checkpoint, dtype="float32", speculative_config=spec, **STRESS)
    planned = llm.engine.runner = PlannedRunner(llm.engine.runner)
    assert outputs(llm, params) == expected
    assert llm.get_stats()["num_preemptions"] > 0 and planned.num_plans > 0
    assert planned.mirrors.seqs == {} and planned.encoder.sent == {}  # every finished sequence forgotten
