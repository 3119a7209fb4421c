"""Suffix decoding's draft trees in the engine (method "suffix" with topk > 1: the tree step verifies
the drafter's trees, tree/host_drafter.py): greedy output equals plain greedy output in fp32 (a
batch, chunked prefill with preemption, the shipped default model on the repetitive set), with
trees that branch; seeded sampling reproducible; no KV block or drafter state outlives a request;
bad configs named."""

from __future__ import annotations

import pytest

import foretell.spec_decode.suffix as suffix_module
from fixtures.spec_prompts import PROMPTS, STRESS
from foretell import LLM, SamplingParams
from foretell.spec_decode.suffix_draft_tree import draft_tree

MAX_TOKENS = 24
TREE = {"method": "suffix", "num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 7,
        "suffix_decoding_min_match_length": 1, "suffix_decoding_min_token_prob": 0.0,
        "suffix_decoding_min_accepted_tokens": 0}


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def branching(monkeypatch) -> list[int]:
    """Counts the drafted trees with a node of two children or more (a branch)."""
    counts = [0, 0]  # trees, branching trees

    def counted(*args, **kwargs):
        tree = draft_tree(*args, **kwargs)
        counts[0] += bool(tree.token_ids)
        counts[1] += len(set(tree.parents)) < len(tree.parents)
        return tree

    monkeypatch.setattr(suffix_module, "draft_tree", counted)
    return counts


def check_done(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    runner = llm.engine.runner
    assert not runner.tree_step.trees and runner.proposer.states == {}


@pytest.mark.parametrize("mode", ["batch", "stress", "queued", "queued-stress"])
def test_greedy_suffix_trees_equal_plain_greedy(qwen3_checkpoint, branching, mode):
    """queued: steps without trees decode plainly, queued ahead (runner/host_tree_steps.py;
    the GPU's default), the tree step taking the steps that verify trees and the prefills."""
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128)
    expected = ids(plain.generate(PROMPTS, greedy(), use_tqdm=False))
    options = dict(STRESS) if "stress" in mode else dict(num_kv_blocks=128)
    if mode == "queued-stress":  # (a queued step reserves its row too: a few more blocks for the longest request)
        options["num_kv_blocks"] += 4
    options["async_scheduling"] = "on" if "queued" in mode else "off"
    llm = LLM(qwen3_checkpoint, dtype="float32", speculative_config=TREE, **options)
    runner = llm.engine.runner
    assert runner.tree_step is not None and runner.tree_step.host_trees
    assert runner.pipeline.queue_ahead == ("queued" in mode)
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == expected
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
    assert branching[1] > 0  # some trees branch (their nodes verified side by side)
    if "queued" in mode:
        assert runner.pipeline.num_used > 0  # plain steps taken as queued ahead
    if "stress" in mode:
        assert stats["num_preemptions"] > 0
    check_done(llm)
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == expected  # the cached responses draft too
    check_done(llm)


def test_default_model_trees_on_the_repetitive_set_equal_plain(branching):
    from foretell.bench.repetitive import repetitive_prompts
    from foretell.defaults import default_target

    prompts = [p.text for p in repetitive_prompts(4)]
    plain = LLM(default_target(), dtype="float32", num_kv_blocks=256)
    expected = ids(plain.generate(prompts, greedy(40), use_tqdm=False))
    spec = {"method": "suffix", "num_speculative_tokens": 8, "topk": 2, "num_draft_tokens": 12}
    llm = LLM(default_target(), dtype="float32", num_kv_blocks=256, speculative_config=spec)
    assert ids(llm.generate(prompts, greedy(40), use_tqdm=False)) == expected
    assert llm.get_stats()["mean_acceptance_length"] > 2.5  # the quoted answers drafted as trees
    assert branching[0] > 0
    check_done(llm)


def test_sampled_trees_are_reproducible_with_a_seed(qwen3_checkpoint, branching):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
              for s in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=TREE)
        runs.append(ids(llm.generate(PROMPTS, params, use_tqdm=False)))
        assert llm.get_stats()["num_drafts"] > 0
        size = llm.engine.runner.vocab_size
        check_done(llm)
    assert runs[0] == runs[1]
    assert all(len(r) == MAX_TOKENS and all(0 <= t < size for t in r) for r in runs[0])
    assert branching[0] > 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "ngram", "topk": 2}, "need method 'eagle3', 'draft_model' or 'suffix'"),
    ({"method": "suffix", "topk": 2, "hybrid": "eagle3", "model": "x"}, "do not take speculative_config hybrid"),
    ({"method": "suffix", "topk": 2, "num_draft_tokens": 40}, "must be an integer in [2, 11]"),
])
def test_bad_suffix_tree_configs_are_named(qwen3_checkpoint, spec, message):
    with pytest.raises(ValueError) as error:
        LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32,
            speculative_config={"num_speculative_tokens": 3, **spec})
    assert message in str(error.value)
