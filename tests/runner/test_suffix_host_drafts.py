"""Host drafters (suffix, n-gram) on the padded verify step (runner/host_drafts.py).

Their verifies take the padded device step (graphed_verify.GraphedVerify with HostDraftSlots: no
device draft loop), on the target's graphs or, without them (the CPU's torch backend), on the same
buffers run eagerly with the GPU's verify lengths (host_draft_verify_lens), and they draft from the
host's token lists, with no device work. The host step (their CPU path before; tensor parallelism's
still) is the reference: fixtures/padded_step.host_step_for_host_drafters. Hybrid drafters on the
padded step: test_hybrid_padded_step.py.
test_suffix_host_drafts_triton.py runs them on the Triton backend's graph buffers (slow). Checked:
  - the verify lengths the graphs take for a host drafter (host_draft_verify_lens: K = 16 gives
    1, 5, 9, 17) and every padded step taking the fewest rows that hold its longest draft;
  - greedy output equals plain greedy output (fp32) for suffix and n-gram, batches with unequal
    draft counts (padded rows), chunked prefill and preemption;
  - the padded step gives the host step's tokens and logprobs for greedy rows beside seeded
    sampled rows, which are reproducible;
  - steps without drafts queued ahead (async scheduling on, forced on the CPU) stay exact and are used;
  - no torch call while a host drafter drafts (the host step gathered rows for it before);
  - token_draft_batch hands the drafter what HostStep.draft_batch did (histories, positions);
  - HostDraftSlots: verify lengths, no drafts on the device.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.padded_step import host_step_for_host_drafters
from fixtures.spec_prompts import PROMPTS, STRESS
from foretell import LLM, SamplingParams
from foretell.bench.suffix_host_cost import _StepCalls
from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_drafts import HostDraftSlots, host_draft_verify_lens, token_draft_batch
from foretell.runner.host_step import HostStep
from foretell.runner.input_batch import build_input_batch
from foretell.runner.sequence_result import SequenceResult
from foretell.spec_decode.suffix import SuffixProposer

MAX_TOKENS = 20
SPECS = {
    "suffix": {"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": 6,
               "suffix_decoding_min_match_length": 2},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
}


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(folder, params, spec=None, prompts=PROMPTS, **options):
    options = {"num_kv_blocks": 128, **options}
    llm = LLM(folder, dtype="float32", speculative_config=spec, **options)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    return ids(run(qwen3_checkpoint, greedy())[1])


def padded(llm):
    """The padded verify step's kind (with steps queued ahead a plain decode step's comes first)."""
    return next(kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, GraphedVerify))


@pytest.mark.parametrize("method", ["suffix", "ngram"])
@pytest.mark.parametrize("mode", ["batch", "stress"])
def test_greedy_equals_plain_on_the_padded_step(qwen3_checkpoint, plain, method, mode):
    llm, outputs = run(qwen3_checkpoint, greedy(), SPECS[method], **(STRESS if mode == "stress" else {}))
    assert ids(outputs) == plain
    runner = llm.engine.runner
    assert isinstance(runner.draft_graphs, HostDraftSlots)
    assert runner.draft_graphs.verify_lens == {"suffix": (1, 3, 4, 6), "ngram": (1, 2, 3, 4)}[method]  # K = 5, 3
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
    assert padded(llm).num_steps > 0
    if mode == "batch":
        assert padded(llm).num_mixed_steps > 0  # sequences with fewer drafts than the step verifies
    else:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_steps_pad_to_the_smallest_verify_length_that_holds_their_longest_draft(qwen3_checkpoint, plain,
                                                                                 monkeypatch):
    """K = 16 (the suffix drafter's usual): the graphs take 1, 5, 9 and 17 rows per sequence, and
    each step pads to the fewest that hold 1 + its longest draft (issue 29: every drafting step
    took 17 before); greedy output equals plain."""
    spec = dict(SPECS["suffix"], num_speculative_tokens=16, suffix_decoding_max_tree_depth=24)
    steps = []  # (rows per sequence, 1 + the longest draft, sequences) of every padded step
    launch = GraphedVerify.launch

    def recorded(self, sched, batch):
        launched = launch(self, sched, batch)
        if launched is not None:
            most = 1 + max(len(item.draft_token_ids) for item in sched.scheduled)
            steps.append((launched.key[1], most, len(sched.scheduled)))
        return launched

    monkeypatch.setattr(GraphedVerify, "launch", recorded)
    llm, outputs = run(qwen3_checkpoint, greedy(), spec)
    assert ids(outputs) == plain
    assert llm.engine.runner.draft_graphs.verify_lens == (1, 5, 9, 17)
    assert steps and all(q == min(b for b in (1, 5, 9, 17) if b >= most) for q, most, _ in steps)
    assert {q for q, most, _ in steps if most > 1} & {5, 9}, "no drafting step took a shorter graph"
    rows, rows_at_17 = (sum(n * q for q, _, n in steps),
                        sum(n * (1 if most == 1 else 17) for _, most, n in steps))
    print(f"K = 16: {len(steps)} padded steps, {rows} target rows ({rows_at_17} padded to 1 or 17 rows)")
    assert rows < rows_at_17


def test_host_draft_verify_lens():
    assert host_draft_verify_lens(16) == (1, 5, 9, 17)
    assert host_draft_verify_lens(8) == (1, 3, 5, 9)
    assert host_draft_verify_lens(5) == (1, 3, 4, 6)
    assert host_draft_verify_lens(3) == (1, 2, 3, 4)
    assert host_draft_verify_lens(1) == (1, 2)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
            host_draft_verify_lens(bad)


def test_verifies_no_longer_take_the_host_step(qwen3_checkpoint, monkeypatch):
    verifies_on_host = []
    sample = HostStep.sample

    def counted(self, sched, batch, logits, results):
        verifies_on_host.append(any(item.draft_token_ids for item in sched.scheduled))
        return sample(self, sched, batch, logits, results)

    monkeypatch.setattr(HostStep, "sample", counted)
    llm, _ = run(qwen3_checkpoint, greedy(), SPECS["suffix"], max_num_seqs=2)
    assert llm.get_stats()["num_drafts"] > 0 and not any(verifies_on_host)  # prefills only


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_padded_step_equals_the_host_step(qwen3_checkpoint, method):
    """Greedy requests with logprobs beside seeded sampled ones: the greedy rows' tokens and
    logprobs are the host step's; the sampled rows are reproducible. (A sampled row's draws on the
    padded step follow its noise keyed by position, rejection_sampler.sample_padded, which is the
    target's distribution but not the host step's plain sampler's draw: test_padded_sampling.py.)"""
    spec = dict(SPECS[method], **({"suffix_decoding_min_token_prob": 0.0} if method == "suffix" else {}))
    params = [greedy(logprobs=1), greedy(logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.2, max_tokens=MAX_TOKENS, ignore_eos=True, seed=9, logprobs=2)]

    def generate():
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return llm, ids(outs), [[(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs or []]
                                for o in outs]

    with host_step_for_host_drafters():
        reference, ref_tokens, ref_logprobs = generate()  # the host step
    assert reference.engine.runner.draft_graphs is None
    llm, tokens, logprobs = generate()
    assert padded(llm).num_sampled_steps > 0 and padded(llm).num_logprob_steps > 0
    assert llm.get_stats()["num_accepted_tokens"] > 0
    assert generate()[1:] == (tokens, logprobs)  # seeded: reproducible
    assert tokens[:2] == ref_tokens[:2]
    assert logprobs[:2] == ref_logprobs[:2]
    assert all(len(t) == MAX_TOKENS for t in tokens)


def test_steps_without_drafts_are_queued_ahead(qwen3_checkpoint, plain):
    # async scheduling forced on the CPU: a step of no drafts (q = 1) queues the next one
    llm, outputs = run(qwen3_checkpoint, greedy(), SPECS["suffix"], async_scheduling="on")
    assert ids(outputs) == plain
    pipeline = llm.engine.runner.pipeline
    assert pipeline.queue_ahead and pipeline.num_launched > 0 and pipeline.num_used > 0
    assert pipeline.num_used <= pipeline.num_launched
    assert llm.get_stats()["num_accepted_tokens"] > 0


def count_step_calls(folder, spec) -> tuple[dict, int]:
    """Torch calls per engine step of a run, those made while drafting apart (HostStep.propose
    on the host step, the proposer's propose after a padded one)."""
    llm = LLM(folder, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    engine = llm.engine
    mode = _StepCalls()

    def marked(propose):
        def drafting(*args):
            mode.drafting = True
            try:
                return propose(*args)
            finally:
                mode.drafting = False
        return drafting

    runner = engine.runner
    runner.host_step.propose = marked(runner.host_step.propose)
    runner.proposer.propose = marked(runner.proposer.propose)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy())
    steps = 0
    with mode:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    assert llm.get_stats()["num_drafts"] > 0
    return mode.counts, steps


def test_host_drafting_makes_no_device_calls(qwen3_checkpoint, monkeypatch):
    """The host step: drafting gathers no rows any more. The padded step (the CPU's path now):
    drafting makes no torch call either, and the step fewer than the host step's."""
    with host_step_for_host_drafters():
        host, steps = count_step_calls(qwen3_checkpoint, SPECS["suffix"])
        assert host["drafter_torch_calls"] == 0
        # before: the same step gathered the valid rows' ids and hidden states for the drafter
        monkeypatch.setattr(HostStep, "propose", _propose_with_rows)
        gathered, _ = count_step_calls(qwen3_checkpoint, SPECS["suffix"])
        assert gathered["drafter_torch_calls"] > 0
        monkeypatch.undo()
    counts, padded_steps = count_step_calls(qwen3_checkpoint, SPECS["suffix"])
    assert padded_steps == steps  # the same steps (same drafts, same acceptance)
    assert counts["drafter_torch_calls"] == 0
    print(f"per step, padded step vs host step: {counts['read_backs'] / steps:.2f} vs "
          f"{host['read_backs'] / steps:.2f} reads back (the torch backend reads its lengths once a forward), "
          f"{counts['tensors_from_lists'] / steps:.2f} vs {host['tensors_from_lists'] / steps:.2f} tensors from "
          f"lists, {counts['torch_calls'] / steps:.0f} vs {host['torch_calls'] / steps:.0f} torch calls")
    assert counts["tensors_from_lists"] < host["tensors_from_lists"]


def _propose_with_rows(self, sched, batch, hidden, aux, results):
    """HostStep.propose as it was: every drafter handed the gathered rows (draft_batch)."""
    proposal = self.proposer.propose(self.draft_batch(sched, batch, hidden, aux, results))
    for result, drafts in zip(results, proposal.token_ids):
        result.next_drafts = drafts


def test_host_step_hands_host_drafters_no_device_rows(qwen3_checkpoint, monkeypatch):
    """Prefill steps (and grammar requests) still take the host step: its draft batch for a host
    drafter has no device tensors and no rows gathered."""
    batches = []
    propose = SuffixProposer.propose

    def seen(self, batch):
        batches.append(batch)
        return propose(self, batch)

    monkeypatch.setattr(SuffixProposer, "propose", seen)
    llm, _ = run(qwen3_checkpoint, greedy(), SPECS["suffix"], **STRESS)
    assert batches and all(b.token_ids.numel() == 0 and b.hidden_states.numel() == 0 for b in batches)


def _sequence(seq_id, prompt, outputs, computed, blocks):
    seq = Sequence(seq_id, str(seq_id), 0, prompt, greedy(), frozenset())
    seq.token_ids.extend(outputs)
    seq.num_computed_tokens = computed
    seq.block_ids = blocks
    return seq


def test_token_draft_batch_matches_the_host_steps_draft_batch():
    # a verify that accepted 1 of 2 drafts, a decode, a prefill chunk that does not sample
    verify = _sequence(0, [1, 2, 3, 4], [5], 4, [0, 3])
    decode = _sequence(1, [7, 8], [9, 10], 3, [1])
    chunk = _sequence(2, [11, 12, 13, 14, 15, 16], [], 2, [2])
    sched = SchedulerOutput([ScheduledSequence(verify, 3, [6, 7], True), ScheduledSequence(decode, 1, [], True),
                             ScheduledSequence(chunk, 2, [], False)], num_next_drafts=2)
    results = [SequenceResult([6, 99], num_accepted=1), SequenceResult([42]), SequenceResult()]
    batch = build_input_batch(sched.scheduled, 4, torch.device("cpu"))
    hidden = torch.zeros(batch.num_tokens, 8)
    host_step = HostStep(None, None, None, 32, 4, 64, torch.device("cpu"))
    expected = host_step.draft_batch(sched, batch, hidden, [], results)
    got = token_draft_batch(sched, results, 4, 64)
    for name in ("start_positions", "num_valid_rows", "next_token_ids", "samples", "histories", "seq_ids",
                 "sample_indices", "max_model_len", "max_drafts", "block_size"):
        assert getattr(got, name) == getattr(expected, name), name
    assert got.histories == [[1, 2, 3, 4, 5, 6, 99], [7, 8, 9, 10, 42], [11, 12, 13, 14, 15]]
    assert got.token_ids.numel() == 0 and got.hidden_states.numel() == 0 and got.aux_hidden_states == []


class _Forward:
    query_lens = (1, 5)
    buckets = [1, 2, 4]
    device = torch.device("cpu")


def test_host_draft_slots():
    slots = HostDraftSlots(_Forward(), k=4)
    assert slots.verify_lens == (1, 5) and not slots.captures and slots.graphs == {}
    assert slots.accepted.shape == (4,) and slots.next_token.shape == (4,)
    assert slots.run(4, 3, 5, 4).shape == (3, 0)  # no drafts on the device, whatever m
    slots.capture()  # nothing to capture
    assert HostDraftSlots(_Forward(), k=2).verify_lens == (1,)  # only lengths up to K + 1
