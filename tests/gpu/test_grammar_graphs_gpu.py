"""On a CUDA GPU: grammar requests verify on the padded step's captured graphs
(structured/padded_verify.py, issue 27/31). For eagle3, draft_model and MTP (fp32, the fixtures):
greedy output under a regex, a choice and a grammar equals the host step's (the same engine with
GraphedVerify.enabled off) token for token and matches its constraint; the draft loop of a grammar
step is a graph replay (never DraftGraphRunner's eager loop, never the proposer's masked host
loop after a verify); each grammar verify step dispatches few eager ops (the verification, the
masks' copy and op, the inputs) where the host step's masked draft loop dispatched hundreds, and
reads the device once. Prints ops and syncs per step for both forms."""

from __future__ import annotations

import pytest
import torch

from fixtures import deepseek as ds
from fixtures.grammar_prompts import DS_PROMPTS, K, PROMPTS, constraints
from foretell import LLM, SamplingParams
from foretell.bench.op_counter import OpCounter
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_step import HostStep
from foretell.spec_decode.draft_graph import DraftGraphRunner


def padded_kinds(llm):
    return [kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, GraphedVerify)]


def run(llm, prompts, steps=None):
    """Each constraint's token ids, checked; with `steps`, (verified drafts?, eager ops) per
    engine step appended."""
    runner = llm.engine.runner
    execute = runner.execute

    def counted(sched):
        counter = OpCounter()
        with counter:
            out = execute(sched)
        steps.append((any(item.draft_token_ids for item in sched.scheduled), counter.count))
        return out

    if steps is not None:
        runner.execute = counted
    try:
        results = []
        for structured, check in constraints():
            params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)
            outs = llm.generate(prompts, params, use_tqdm=False)
            for out in outs:
                assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text
            results.append([out.outputs[0].token_ids for out in outs])
        return results
    finally:
        if steps is not None:
            del runner.execute


def check_grammar_on_graphs(llm, prompts, monkeypatch):
    runner = llm.engine.runner
    assert runner.graphs.captures and isinstance(runner.draft_graphs, DraftGraphRunner) and runner.draft_graphs.graphs
    kinds = padded_kinds(llm)
    for kind in kinds:
        kind.enabled = False
    host_steps = []
    expected = run(llm, prompts, host_steps)
    for kind in kinds:
        kind.enabled = True

    eager_loops, host_loops, replays = [], [], []
    loop, propose = DraftGraphRunner._loop, HostStep.propose
    monkeypatch.setattr(DraftGraphRunner, "_loop", lambda self, *a: eager_loops.append(a) or loop(self, *a))
    monkeypatch.setattr(HostStep, "propose", lambda self, sched, *a: host_loops.append(
        any(item.draft_token_ids for item in sched.scheduled)) or propose(self, sched, *a))
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self))
    grammar_steps = sum(kind.num_grammar_steps for kind in kinds)
    padded_steps = []
    got = run(llm, prompts, padded_steps)
    assert got == expected
    assert sum(kind.num_grammar_steps for kind in kinds) > grammar_steps
    assert not eager_loops, "a grammar step ran the draft loop eagerly"
    assert not any(host_loops), "the proposer's masked host loop ran after a verify"
    padded_ops = [ops for verified, ops in padded_steps if verified]
    host_ops = [ops for verified, ops in host_steps if verified]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    print(f"grammar verify steps: padded {len(padded_ops)}, {mean(padded_ops):.0f} eager ops a step, "
          f"{len(replays)} graph replays; host step {len(host_ops)}, {mean(host_ops):.0f} eager ops a step")
    assert mean(padded_ops) * 3 < mean(host_ops)


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_grammar_verifies_on_the_graphs(method, request, qwen3_checkpoint, monkeypatch):
    spec = {"method": method, "num_speculative_tokens": K}
    spec["model"] = request.getfixturevalue("eagle3_head" if method == "eagle3" else "qwen3_tied_checkpoint")
    with LLM(qwen3_checkpoint, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
             speculative_config=spec) as llm:
        check_grammar_on_graphs(llm, PROMPTS, monkeypatch)


def test_mtp_grammar_verifies_on_the_graphs(checkpoint_root, tokenizer_dir, monkeypatch):
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    with LLM(folder, device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        check_grammar_on_graphs(llm, [{"prompt_token_ids": p} for p in DS_PROMPTS], monkeypatch)


def test_a_grammar_step_reads_the_device_once(qwen3_checkpoint, eagle3_head):
    """At batch 1 a grammar verify step waits for the device once (its results): counted by the
    CUDA syncs the host makes, through torch.cuda.Event.synchronize and tensor reads."""
    from foretell.bench.device_syncs import syncs_per_step

    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": K}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, structured_outputs={"regex": r"(.|\n)*"})
    with LLM(qwen3_checkpoint, device="cuda", dtype="float32", num_kv_blocks=256, speculative_config=spec) as llm:
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
        steps, _ = syncs_per_step(llm, [PROMPTS[0]], params)
    verifies = [counts for verified, counts in steps if verified]
    assert verifies
    for counts in verifies:
        assert counts["syncs"] <= 1, counts["sites"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_host_drafters_grammars_verify_on_the_graphs(method, qwen3_checkpoint):
    """A host drafter's grammar requests verify on the target's captured graphs (HostDraftSlots:
    no draft loop; the drafts shaped by the grammar after the drafter proposes), the host step's
    tokens, every output inside its constraint."""
    from foretell.runner.host_drafts import HostDraftSlots

    spec = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    with LLM(qwen3_checkpoint, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
             speculative_config=spec) as llm:
        runner = llm.engine.runner
        assert runner.graphs.captures and isinstance(runner.draft_graphs, HostDraftSlots)
        kinds = padded_kinds(llm)
        for kind in kinds:
            kind.enabled = False
        expected = run(llm, PROMPTS)
        for kind in kinds:
            kind.enabled = True
        grammar_steps = sum(kind.num_grammar_steps for kind in kinds)
        got = run(llm, PROMPTS)
        assert sum(kind.num_grammar_steps for kind in kinds) > grammar_steps
        assert llm.get_stats()["num_drafts"] > 0
    assert got == expected
