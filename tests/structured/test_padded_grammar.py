"""Grammars on the padded verify step (structured/padded_verify.py, issue 27/31).

- The mask layout: padded_verify_grammar() puts each structured sequence's verify rows at its
  padded rows (i * q ..), its padding rows repeating its last real row, a sequence without a
  grammar allowing everything; the rows equal SequenceMatcher.verify_masks' (the one-sequence
  walk, an independent reference) for the same drafts; too many rows is a clear error.
- The engine, greedy, fp32 on the fixtures: with eagle3, draft_model and MTP a grammar request
  verifies on the padded step (counted) and its tokens equal the host step's (the same engine
  with GraphedVerify.enabled off) token for token, and every output matches its constraint; the
  proposer's own (host, masked, eager) draft loop runs only after prefill chunks; n-gram and
  suffix (host drafters: their drafts proposed, and shaped by the grammar, after the padded step's
  read) verify grammar requests on the padded step too where the target has its padded forward
  (on the CPU installed as the GPU's graphs would be), the host step's tokens; without it (the
  CPU's default) they stay on the host step.
- A batch mixing a grammar request with plain ones and other draft counts (padded rows), and
  sampled grammar requests, on the padded step: plain greedy's tokens, inside the grammar.
- structured_forced_drafts on the padded step: on, forced drafts are counted and no verify
  passes K; off, none is counted; both give the host step's tokens.
- One device->host sync a grammar step (the read), where the host step needed K + 1 (not
  counting the draft loop's host-length reads of the CPU's torch attention, which CUDA has not).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures import deepseek as ds
from fixtures.grammar_prompts import DS_PROMPTS, K, PROMPTS, constraints
from fixtures.grammar_stubs import VOCAB, FakeSeq, SamplingItem, encode
from foretell import LLM, SamplingParams
from foretell.bench.device_syncs import syncs_per_step
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_step import HostStep
from foretell.structured.padded_verify import GrammarMaskBuffer, padded_verify_grammar


def padded_kinds(llm: LLM) -> list[GraphedVerify]:
    return [kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, GraphedVerify)]


def run(llm: LLM, prompts, temperature: float = 0.0) -> list[list[tuple[int, ...]]]:
    """Each constraint's outputs (token ids), every output checked against it."""
    results = []
    for structured, check in constraints():
        params = SamplingParams(temperature=temperature, seed=3 if temperature else None, max_tokens=40,
                                structured_outputs=structured)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out in outs:
            assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text
        results.append([tuple(out.outputs[0].token_ids) for out in outs])
    return results


def host_step_run(llm: LLM, prompts) -> list:
    """run() with every verify on the host step (the padded kinds off for it)."""
    kinds = padded_kinds(llm)
    for kind in kinds:
        kind.enabled = False
    try:
        return run(llm, prompts)
    finally:
        for kind in kinds:
            kind.enabled = True


def count_proposer_loops(monkeypatch) -> list[bool]:
    """Per HostStep.propose call (the proposer's own draft loop, masked by the grammar): whether
    its batch verified drafts (False: it followed prefill rows only)."""
    calls = []
    propose = HostStep.propose

    def counted(self, sched, *args):
        calls.append(any(item.draft_token_ids for item in sched.scheduled))
        return propose(self, sched, *args)

    monkeypatch.setattr(HostStep, "propose", counted)
    return calls


# ---- the mask layout ----------------------------------------------------------------------
def test_padded_rows_hold_each_sequences_verify_masks(runtime, hf):
    eos = frozenset({hf.eos_token_id})
    grammar = SamplingParams(temperature=0, structured_outputs={"regex": r"[0-9]{1,2}-abcab-(x|yy)ba\."})
    seqs = [FakeSeq(grammar, encode(hf, "1"), eos, 0), FakeSeq(SamplingParams(temperature=0), [5], eos, 1),
            FakeSeq(grammar, encode(hf, "12-ab"), eos, 2)]
    drafts = [encode(hf, "2-a"), [7, 8], encode(hf, "cq")]  # the third: "q" is rejected
    items = [SamplingItem(seq) for seq in seqs]
    for item, d in zip(items, drafts):
        item.draft_token_ids = d
    q = 1 + max(len(d) for d in drafts)
    buffer = GrammarMaskBuffer(64, torch.device("cpu"))
    step = padded_verify_grammar(runtime, buffer, items, q, max_drafts=K)
    rows = step.bitmask.numpy()  # [3 * q, words]
    assert rows.shape == (3 * q, runtime.num_words)
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        span = rows[i * q: (i + 1) * q]
        if seq.sampling_params.structured_outputs is None:
            assert (span == -1).all()
            continue
        reference = np.zeros((len(d) + 1, runtime.num_words), dtype=np.int32)
        runtime.matchers[seq.seq_id].verify_masks(d, reference)  # one sequence's walk, rolled back
        assert (span[: len(d) + 1] == reference).all()
        assert (span[len(d) + 1:] == reference[-1]).all()  # padding rows repeat the last real one
    # The masks on logits: -inf exactly where a bit is 0, and the raw logits untouched.
    raw = torch.randn(3, q, VOCAB)  # [n, q, vocab]
    before = raw.clone()
    masked = step.apply(raw, raw)
    allowed = torch.from_numpy(((rows[:, :, None] >> np.arange(32)) & 1).reshape(3 * q, -1)[:, :VOCAB] == 1)
    assert torch.equal(raw, before)
    assert torch.equal(torch.isinf(masked).view(3 * q, VOCAB), ~allowed)
    assert torch.equal(masked.view(3 * q, VOCAB)[allowed], raw.view(3 * q, VOCAB)[allowed])


def test_no_grammar_means_no_masks_and_too_many_rows_is_an_error(runtime):
    items = [SamplingItem(FakeSeq(SamplingParams(temperature=0), [5], frozenset({1})))]
    items[0].draft_token_ids = [3]
    buffer = GrammarMaskBuffer(4, torch.device("cpu"))
    assert padded_verify_grammar(runtime, buffer, items, 2, max_drafts=K) is None
    with pytest.raises(ValueError, match="a padded step of 5 rows, more than the padded forward's 4"):
        buffer.host_rows(5, runtime.num_words)


# ---- the engine ---------------------------------------------------------------------------
def spec_config(method: str, request) -> dict:
    config = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        config["model"] = request.getfixturevalue("qwen3_tied_checkpoint")
    elif method == "eagle3":
        config["model"] = request.getfixturevalue("eagle3_head")
    elif method == "ngram":
        config["prompt_lookup_min"] = 1
    return config


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_greedy_grammar_on_the_padded_step_equals_the_host_step(method, request, qwen3_checkpoint, monkeypatch):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
             speculative_config=spec_config(method, request)) as llm:
        expected = host_step_run(llm, PROMPTS)
        kinds = padded_kinds(llm)
        loops = count_proposer_loops(monkeypatch)
        got = run(llm, PROMPTS)
    assert got == expected
    assert sum(kind.num_grammar_steps for kind in kinds) > 10
    if method != "ngram":  # (a host drafter proposes after the read: no draft loop)
        assert loops and not any(loops)  # the masked host draft loop ran after prefill rows only


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_host_drafters_verify_grammars_on_the_padded_step(method, qwen3_checkpoint, monkeypatch):
    """On the target's padded forward (uncaptured on the CPU, as the GPU's graphs run it), a host
    drafter's grammar requests verify there: the host step's tokens (the same engine with the
    padded kinds off), every output inside its constraint, drafts shaped by the grammar after the
    drafter proposes (forced tokens drafted: more drafts than the drafter alone would make)."""
    config = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        config["prompt_lookup_min"] = 1
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=config) as llm:
        expected = host_step_run(llm, PROMPTS)
        kinds = padded_kinds(llm)
        structured = llm.engine.runner.host_step.structured
        forced_before = structured.timer.forced_drafts
        got = run(llm, PROMPTS)
        assert sum(kind.num_grammar_steps for kind in kinds) > 10
        assert structured.timer.forced_drafts > forced_before  # shaped after the proposer's drafts
        assert llm.get_stats()["num_drafts"] > 0
    assert got == expected


def test_mtp_grammar_on_the_padded_step_equals_the_host_step(checkpoint_root, tokenizer_dir):
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    prompts = [{"prompt_token_ids": p} for p in DS_PROMPTS]
    with LLM(folder, dtype="float32", num_kv_blocks=64,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        expected = host_step_run(llm, prompts)
        got = run(llm, prompts)
        assert sum(kind.num_grammar_steps for kind in padded_kinds(llm)) > 0
    assert got == expected


@pytest.fixture(scope="module")
def eagle3_llm(qwen3_checkpoint, eagle3_head):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, max_num_seqs=4,
             speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": K}) as llm:
        yield llm


def test_a_batch_mixing_grammar_and_plain_requests(eagle3_llm, qwen3_checkpoint):
    """Grammar and plain requests in one padded step, with other draft counts (padded rows); the
    plain ones greedy without speculation's tokens, the grammar ones their constraint's."""
    structured, check = constraints()[3]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraints()[0][0]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    prompts = PROMPTS + ["Question: what is 3 plus 7? Answer:"]
    kind = padded_kinds(eagle3_llm)[0]
    steps, mixed = kind.num_grammar_steps, kind.num_mixed_steps
    outs = eagle3_llm.generate(prompts, params, use_tqdm=False)
    assert kind.num_grammar_steps > steps and kind.num_mixed_steps > mixed
    assert check(outs[0].outputs[0].text) and constraints()[0][1](outs[2].outputs[0].text)
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as plain:
        expected = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_sampled_grammar_requests_stay_inside_the_grammar(eagle3_llm):
    kind = padded_kinds(eagle3_llm)[0]
    steps, sampled = kind.num_grammar_steps, kind.num_sampled_steps
    run(eagle3_llm, PROMPTS, temperature=1.0)
    assert kind.num_grammar_steps > steps and kind.num_sampled_steps > sampled


@pytest.mark.parametrize("forced", [True, False])
def test_forced_drafts_switch_on_the_padded_step(forced, qwen3_checkpoint, eagle3_head):
    config = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2,
              "structured_forced_drafts": forced}
    structured, _ = constraints()[3]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=config) as llm:
        kinds = padded_kinds(llm)
        for kind in kinds:
            kind.enabled = False
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        for kind in kinds:
            kind.enabled = True
        timer = llm.engine.runner.host_step.structured.timer
        forced_before = timer.forced_drafts
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()
        assert sum(kind.num_grammar_steps for kind in kinds) > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(stats["accepted_per_position"]) == 2  # no verify past K, forced drafts or not
    assert (timer.forced_drafts > forced_before) is forced


def test_a_grammar_step_syncs_once(eagle3_llm):
    """The padded grammar step reads its results once; the host step's masked draft loop read
    each draft the grammar consumed (K + 1 syncs at K = 3)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            structured_outputs={"regex": r"(.|\n)*"})
    eagle3_llm.generate([PROMPTS[0]], params, use_tqdm=False)
    steps, _ = syncs_per_step(eagle3_llm, [PROMPTS[0]], params)
    verifies = [counts for verified, counts in steps if verified]
    assert len(verifies) >= 3
    for counts in verifies:
        # The CPU's torch attention reads each draft forward's lengths on the host (draft_graph.py:
        # such a loop is never captured, and a step without a grammar reads them too).
        sites = {site: n for site, n in counts["sites"].items() if "spec_decode/draft_graph.py" not in site}
        assert sum(sites.values()) <= 1, counts["sites"]
        assert not [site for site in sites if "foretell/structured/" in site]


def test_grammar_with_logits_controls_and_logprobs_equals_the_host_step(eagle3_llm):
    """A grammar beside penalties and a bias (masked after them, on the padded controls' copy)
    and logprobs (the raw logits', unmasked, as on the host step): the host step's tokens and
    logprobs; the bias steers toward a token the grammar forbids (it stays forbidden)."""
    structured, check = constraints()[0]
    params = [SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.4, repetition_penalty=1.2,
                             logit_bias={7: 50.0}, logprobs=2, structured_outputs=structured),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)] * 2
    kind = padded_kinds(eagle3_llm)[0]
    before = (kind.num_grammar_steps, kind.num_controlled_steps, kind.num_logprob_steps)
    got = [o.outputs[0] for o in eagle3_llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)]
    after = (kind.num_grammar_steps, kind.num_controlled_steps, kind.num_logprob_steps)
    assert all(a > b for a, b in zip(after, before))
    kind.enabled = False
    try:
        expected = [o.outputs[0] for o in eagle3_llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)]
    finally:
        kind.enabled = True
    assert check(got[0].text) and check(got[2].text)
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        assert len(g.logprobs) == len(e.logprobs) == len(g.token_ids)
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
