"""Grammars on plain decoding's device step (runner/decode_ahead.py, issues 27 and 31): in an
engine without a drafter deciding ahead (async_scheduling on), a decode batch whose sequences
follow grammars takes DecodeAhead (its masks filled from the matchers, uploaded once, applied on
the device before sampling) instead of the host step; with async scheduling the step after it is
queued ahead as its forward alone, masked and sampled once the scheduler takes it.

The reference is the host step: the same engine with async_scheduling off (no DecodeAhead in its
pipeline: every step the host step's). In fp32, tokens equal it token for token:
- greedy, for a JSON schema, a regex, a choice, a Lark grammar and a regex with long forced runs,
  each output inside its constraint, on the eager forward and on the graph runner's (uncaptured:
  the GPU's buffers and forward, as tests/runner/test_decode_advance.py installs it);
- seeded sampling (temperature 0.8), with logits controls and logprobs on the grammar rows;
- a batch mixing grammar rows with plain ones (greedy and sampled, a grammar that ends while the
  plain rows go on: the plain rows queue ahead again once it is gone), more sequences than the mask
  buffer first holds (it grows).
- a grammar request aborted mid-run, while the step after it is queued ahead: the others' tokens
  equal the host step's and every KV block comes back.
Counts: DecodeAhead launched the grammar steps (num_grammar_steps), the host step sampled prefill
batches only, and grammar steps queued ahead were taken (the pipeline's num_used; a queued forward
is dropped when its batch changes: a sequence ends, rows join). plain_decode() keeps grammar rows
out of plain steps queued ahead (a unit check), and an engine with a drafter keeps its DecodeAhead
grammar-free.
"""

from __future__ import annotations

import pytest

from fixtures.grammar_prompts import PROMPTS, constraints
from fixtures.padded_step import record_host_steps, uncaptured_decode_graphs
from foretell import LLM, SamplingParams
from foretell.runner.cuda_graph import CudaGraphRunner
from foretell.runner.decode_ahead import DecodeAhead, plain_decode

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


def all_constraints() -> list[tuple[dict, object]]:
    """constraints() (regex, choice, grammar, forced regex) and a JSON schema, each with its check."""
    import json

    def schema_check(text: str) -> bool:
        value = json.loads(text)
        return set(value) == {"a", "b"} and 0 <= value["a"] <= 9 and value["b"] in ("x", "yz")

    return [({"json": SCHEMA, "disable_any_whitespace": True}, schema_check), *constraints()]


def engine(checkpoint: str, mode: str, **options) -> LLM:
    return LLM(checkpoint, dtype="float32", num_kv_blocks=128, async_scheduling=mode,
               **{"max_num_seqs": 4, **options})


def decode_kind(llm: LLM) -> DecodeAhead:
    (kind,) = [kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, DecodeAhead)]
    return kind


def install_graph_runner(llm: LLM) -> CudaGraphRunner:
    """The target's decode buffers and forward as the GPU's graphs give them (uncaptured)."""
    return uncaptured_decode_graphs(llm)


def generate(llm: LLM, prompts, params) -> list[tuple]:
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason,
             [sorted(lp.items()) if isinstance(lp, dict) else lp for lp in (o.outputs[0].logprobs or [])])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def constrained(temperature: float, **extra) -> list[tuple[SamplingParams, object]]:
    return [(SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=40,
                            structured_outputs=structured, **extra), check)
            for structured, check in all_constraints()]


@pytest.mark.parametrize("graphed", [False, True])
def test_greedy_grammar_decode_equals_the_host_step(qwen3_checkpoint, monkeypatch, graphed):
    cases = constrained(0.0)
    with engine(qwen3_checkpoint, "off") as reference:
        expected = [generate(reference, PROMPTS, params) for params, _ in cases]
    with engine(qwen3_checkpoint, "on") as llm:
        advances = []
        if graphed:  # a queued grammar step's inputs move on the device (advance_decode), as a greedy step's
            graphs = install_graph_runner(llm)
            advance = graphs.advance_decode
            monkeypatch.setattr(graphs, "advance_decode", lambda *args: (advances.append(1), advance(*args))[1])
        host_steps = record_host_steps(monkeypatch)
        kind = decode_kind(llm)
        assert kind.structured is not None
        got = [generate(llm, PROMPTS, params) for params, _ in cases]
        assert kind.num_grammar_steps > 0
        assert (len(advances) > 0) == graphed
        assert host_steps and all(host_steps)  # the host step sampled prefill batches only
        pipeline = llm.engine.runner.pipeline
        assert pipeline.num_used > 0 and kind.num_grammar_steps > pipeline.num_used  # some from host inputs
    assert got == expected
    for (params, check), outs in zip(cases, got):
        for tokens, text, reason, _ in outs:
            assert reason == "stop" and check(text), (params.structured_outputs, text)


def test_sampled_grammar_decode_with_controls_and_logprobs_equals_the_host_step(qwen3_checkpoint, monkeypatch):
    """Seeded sampling; repetition penalty and a logit bias on the grammar rows (the mask after
    them), logprobs of the raw logits."""
    cases = constrained(0.8, repetition_penalty=1.3, logit_bias={5: 4.0, 17: -3.0}, logprobs=2)
    with engine(qwen3_checkpoint, "off") as reference:
        expected = [generate(reference, PROMPTS, params) for params, _ in cases]
    with engine(qwen3_checkpoint, "on") as llm:
        host_steps = record_host_steps(monkeypatch)
        got = [generate(llm, PROMPTS, params) for params, _ in cases]
        assert decode_kind(llm).num_grammar_steps > 0 and all(host_steps)
        assert llm.engine.runner.pipeline.num_used > 0  # grammar steps queued ahead (forwards), then sampled
    assert got == expected
    for (params, check), outs in zip(cases, got):
        for tokens, text, reason, logprobs in outs:
            assert reason == "stop" and check(text), (params.structured_outputs, text)
            assert len(logprobs) == len(tokens)


@pytest.mark.parametrize("graphed", [False, True])
def test_mixed_batch_with_a_grammar_that_ends_equals_the_host_step(qwen3_checkpoint, monkeypatch, graphed):
    """Ten sequences (more rows than the mask buffer's first 8): grammar rows (a choice that ends
    after a few tokens, a regex) beside plain greedy and seeded rows running on to max_tokens; once
    the grammar rows are done, the plain rows queue ahead again."""
    choice, regex = ({"choice": ["the book", "a b a b"]}, {"regex": r"(the|cat|[0-9]{1,2})( (the|book|cat)){1,3}\."})
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=choice),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=30, structured_outputs=regex),
              SamplingParams(temperature=0.7, seed=5, max_tokens=28, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=regex, logprobs=1)]
    params = params + params
    prompts = (PROMPTS * 4)[:10]
    with engine(qwen3_checkpoint, "off", max_num_seqs=12) as reference:
        expected = generate(reference, prompts, params)
    with engine(qwen3_checkpoint, "on", max_num_seqs=12) as llm:
        if graphed:
            install_graph_runner(llm)
        host_steps = record_host_steps(monkeypatch)
        kind = decode_kind(llm)
        got = generate(llm, prompts, params)
        assert kind.num_grammar_steps > 0 and all(host_steps)
        assert kind.grammar_masks.max_rows >= 10
        pipeline = llm.engine.runner.pipeline
        assert pipeline.num_used > 0  # the plain rows alone, after the grammars ended
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert got == expected
    for p, (tokens, text, reason, _) in zip(params, got):
        if p.structured_outputs is not None:
            assert reason == "stop" and len(tokens) < p.max_tokens
        else:
            assert reason == "length" and len(tokens) == p.max_tokens


def run_with_an_abort(llm: LLM, prompts: list[str], params: list[SamplingParams], abort_id: str,
                      abort_after: int) -> dict[str, tuple[int, ...]]:
    """The requests run step by step through the engine, `abort_id` aborted after abort_after
    steps; each finished request's tokens."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = tuple(out.outputs[0].token_ids)
        steps += 1
        if steps == abort_after:
            engine.abort_request(abort_id)
    return done


@pytest.mark.parametrize("graphed", [False, True])
def test_an_aborted_grammar_request_leaves_the_others_exact_and_no_blocks(qwen3_checkpoint, graphed):
    """A grammar request aborted while the step after it is queued ahead as a forward: that step is
    dropped (the batch changed), the other grammar and plain rows go on with the host step's tokens
    and every KV block comes back."""
    regex = {"regex": r"(the|cat|[0-9]{1,2})( (the|book|cat)){1,3}\."}
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=regex),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": r"[a-z ]{20,40}"})]
    prompts = PROMPTS[:3]
    with engine(qwen3_checkpoint, "off") as reference:
        expected = run_with_an_abort(reference, prompts, params, "r2", abort_after=4)
    with engine(qwen3_checkpoint, "on") as llm:
        if graphed:
            install_graph_runner(llm)
        got = run_with_an_abort(llm, prompts, params, "r2", abort_after=4)
        assert llm.engine.runner.pipeline.num_used > 0
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert got == expected and set(got) == {"r0", "r1"}


class Item:
    def __init__(self, params: SamplingParams):
        self.seq = type("Seq", (), {"sampling_params": params})()
        self.num_new_tokens, self.samples, self.draft_token_ids = 1, True, []


def test_plain_decode_keeps_grammars_out_of_queued_steps():
    grammar = Item(SamplingParams(temperature=0, structured_outputs={"regex": "ab"}))
    plain = Item(SamplingParams(temperature=0))
    assert plain_decode([plain]) and not plain_decode([plain, grammar])  # a queued step's test (matches)
    assert plain_decode([plain, grammar], grammars=True)  # a launch from host inputs, with `structured`
    drafted = Item(SamplingParams(temperature=0, structured_outputs={"regex": "ab"}))
    drafted.draft_token_ids = [3]
    assert not plain_decode([drafted], grammars=True)
    prefill = Item(SamplingParams(temperature=0, structured_outputs={"regex": "ab"}))
    prefill.num_new_tokens = 4
    assert not plain_decode([prefill], grammars=True)


def test_an_engine_with_a_drafter_keeps_grammars_off_decode_ahead(qwen3_checkpoint):
    """n-gram's DecodeAhead (its steps without drafts) leaves grammar rows to the padded verify or
    the host step, where its drafts are shaped."""
    with engine(qwen3_checkpoint, "on", speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        assert all(kind.structured is None for kind in llm.engine.runner.pipeline.kinds
                   if isinstance(kind, DecodeAhead))
