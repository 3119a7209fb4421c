"""The tree step's verify forward on its graph buffers (runner/tree_graphs.py), run uncaptured on the
CPU over the torch backend (exact buckets: the backend reads host lengths): the tokens and every
target KV cache equal the eager tree step's bit for bit in float32 (Qwen3 and Llama-3.1
layouts, greedy and seeded sampling, batches of 1-3, preemption and trees cut near max_model_len,
which fall back to the eager forward; the draft caches within float32 rounding: the graphed catch-up
pads its rows), greedy equals plain greedy, and bad input is named.
Padding to a bucket needs a graph-safe backend: tests/spec_decode/tree/test_tree_engine_triton.py."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.runner.tree_graphs import TreeVerifyGraphs
from test_tree_engine import PROMPTS, STRESS, TREE, check_blocks_free, greedy, ids, tree_llm
from test_tree_engine import baselines, llama31_eagle3_head, targets  # noqa: F401 (module fixtures)


def graphed(llm: LLM) -> LLM:
    """The engine with verify graphs as StepGraphSetup builds them where a backend is graph-safe,
    but uncaptured and reading host lengths (the torch backend: exact buckets)."""
    runner = llm.engine.runner
    block_size = runner.cache_plan.block_size
    blocks = -(-(runner.max_model_len + runner.num_lookahead_tokens) // block_size) + 1
    runner.tree_step.use_graphs(TreeVerifyGraphs(
        runner.model, llm.engine.config.scheduler.max_num_seqs, runner.tree_step.shape.num_draft_tokens, blocks,
        block_size, runner.max_model_len, runner.device, capture_graphs=False, reads_host_lengths=True))
    return llm


def caches(llm: LLM) -> list[torch.Tensor]:
    runner = llm.engine.runner
    layers = [*runner.model.attention_layers(), *runner.proposer.kv_layers()]
    return [layer.kv_cache for layer in layers]


def run_both(target: str, head: str, prompts, params, tree: dict = TREE, **kwargs):
    """(eager engine, graphed engine, eager outputs, graphed outputs) of one generate call each."""
    eager = tree_llm(target, head, tree, **kwargs)
    assert eager.engine.runner.tree_step.verify_graphs is None  # the torch backend is not graph-safe
    buffered = graphed(tree_llm(target, head, tree, **kwargs))
    return eager, buffered, eager.generate(prompts, params, use_tqdm=False), buffered.generate(prompts, params,
                                                                                                 use_tqdm=False)


def assert_same_caches(a: LLM, b: LLM) -> None:
    """The target's caches bit for bit; the draft's within float32 rounding: after a graphed verify
    the catch-up runs its paths padded to depth + 1 rows (TreeDraftGraphs.run_after_verify), and
    MKL's float32 GEMM rounds a row's sums differently for another row count (layers/cpu_few_rows.py)."""
    num_target = len(a.engine.runner.model.attention_layers())
    for k, (x, y) in enumerate(zip(caches(a), caches(b), strict=True)):
        if k < num_target:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_graphed_tree_verify_equals_eager_and_plain(targets, baselines, family):
    target, head = targets[family]
    eager, buffered, want, got = run_both(target, head, PROMPTS, greedy())
    assert ids(got) == ids(want) == baselines[family]
    assert_same_caches(eager, buffered)
    step = buffered.engine.runner.tree_step
    assert step.num_graphed_verifies > 0 and eager.engine.runner.tree_step.num_graphed_verifies == 0
    assert step.drafter.graphs.num_runs > 0 and eager.engine.runner.tree_step.drafter.graphs is None
    assert buffered.get_stats()["accepted_per_position"] == eager.get_stats()["accepted_per_position"]
    check_blocks_free(buffered)


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_graphed_sampled_trees_equal_eager(targets, family):
    target, head = targets[family]
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=12, ignore_eos=True)
              for t, p, s in ((0.7, 1.0, 1), (1.0, 0.9, 2), (0.0, 1.0, None))]
    eager, buffered, want, got = run_both(target, head, PROMPTS, params, seed=0)
    assert ids(got) == ids(want)
    assert_same_caches(eager, buffered)
    assert buffered.engine.runner.tree_step.num_graphed_verifies > 0
    assert buffered.engine.runner.tree_step.drafter.graphs.num_runs > 0


def test_graphed_batches_of_one_and_two(targets, baselines):
    target, head = targets["qwen3"]
    buffered = graphed(tree_llm(target, head))
    for chosen in ([0], [2, 1]):
        got = ids(buffered.generate([PROMPTS[i] for i in chosen], greedy(), use_tqdm=False))
        assert got == [baselines["qwen3"][i] for i in chosen]
    assert buffered.engine.runner.tree_step.num_graphed_verifies > 0


def test_cut_trees_and_preemption_fall_back_to_the_eager_forward(targets, monkeypatch):
    """Near max_model_len the scheduler cuts trees (fewer rows than T): those steps run eagerly,
    whole-tree steps on the buffers; chunked prefill and preemption (STRESS) in between."""
    target, head = targets["qwen3"]
    tree = {"num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 7}
    plain = LLM(target, dtype="float32", num_kv_blocks=64, max_model_len=40)
    want = ids(plain.generate(PROMPTS, greedy(None), use_tqdm=False))
    buffered = graphed(tree_llm(target, head, tree, max_model_len=40, **STRESS))
    step = buffered.engine.runner.tree_step
    forwards = {"graphed": 0, "eager": 0}
    original = step._verify_forward

    def counted(batch):
        graphed_before = step.num_graphed_verifies
        out = original(batch)
        forwards["graphed" if step.num_graphed_verifies > graphed_before else "eager"] += 1
        return out

    monkeypatch.setattr(step, "_verify_forward", counted)
    assert ids(buffered.generate(PROMPTS, greedy(None), use_tqdm=False)) == want
    assert forwards["graphed"] > 0 and forwards["eager"] > 0
    assert buffered.get_stats()["num_preemptions"] > 0
    check_blocks_free(buffered)


def test_bucket_for_takes_whole_trees_only(targets):
    target, head = targets["qwen3"]
    runner = graphed(tree_llm(target, head, max_num_seqs=40)).engine.runner
    graphs = runner.tree_step.verify_graphs
    assert graphs.buckets[-1] == 40 and graphs.tree_mask.shape == (40 * 8, 8)
    capped = TreeVerifyGraphs(runner.model, 128, 8, 4, 16, 64, runner.device, capture_graphs=False, max_rows=100)
    assert capped.buckets[-1] == 12  # 12 trees of 8 rows fit 100
    assert not capped.captures and capped.tree_mask.all()


def test_bad_num_nodes_is_named(targets):
    target, head = targets["qwen3"]
    runner = tree_llm(target, head).engine.runner
    with pytest.raises(ValueError, match="num_nodes >= 2"):
        TreeVerifyGraphs(runner.model, 4, 1, 4, 16, 64, runner.device)


def test_tree_draft_graphs_refuse_what_does_not_fit(targets):
    """Batches over the largest bucket or inputs of another dtype than the buffers: run() returns
    None (the drafter expands eagerly); bad buckets are named."""
    from foretell.spec_decode.tree.draft_graphs import TreeDraftGraphs

    target, head = targets["qwen3"]
    runner = tree_llm(target, head).engine.runner
    drafter = runner.tree_step.drafter
    graphs = TreeDraftGraphs(drafter, [1, 2], 4, 16, 64, runner.device, reads_host_lengths=True)
    vocab, hidden = graphs.logits.shape[1], graphs.h.shape[1]
    table = torch.zeros(3, 4, dtype=torch.int32)
    assert graphs.run(torch.zeros(3, vocab), torch.zeros(3, hidden), [1, 2, 3], [5, 6, 7], table) is None
    assert graphs.run(torch.zeros(1, vocab, dtype=torch.float64), torch.zeros(1, hidden), [1], [5], table[:1]) is None
    wide_table = torch.zeros(1, 9, dtype=torch.int32)  # wider than the buffers' 4 blocks
    assert graphs.run(torch.zeros(1, vocab), torch.zeros(1, hidden), [1], [5], wide_table) is None
    assert graphs.num_runs == 0
    for buckets in ([], [2, 1], [0, 1]):
        with pytest.raises(ValueError, match="ascending positive sizes"):
            TreeDraftGraphs(drafter, buckets, 4, 16, 64, runner.device)


def test_tree_draft_graphs_equal_the_eager_expansion(targets):
    """The buffers' expansion (exact bucket, host lengths) vs ModelTreeDrafter.expand on the same
    random catch-up outputs: equal trees, and equal scratch KV in the draft cache."""
    from foretell.spec_decode.tree.draft_graphs import TreeDraftGraphs

    target, head = targets["llama31"]
    runner = tree_llm(target, head).engine.runner
    drafter = runner.tree_step.drafter
    block_size = runner.cache_plan.block_size
    graphs = TreeDraftGraphs(drafter, [1, 2, 4], 8, block_size, 64, runner.device, reads_host_lengths=True)
    generator = torch.Generator().manual_seed(0)
    n = 3
    logits = torch.randn(n, graphs.logits.shape[1], generator=generator)
    h = torch.randn(n, graphs.h.shape[1], generator=generator)
    roots, tokens = [9, 20, 33], [5, 6, 7]
    table = torch.stack([torch.randperm(8, generator=generator, dtype=torch.int32) for _ in range(n)])  # [n, 8]
    cache = drafter.proposer.kv_layers()[0].kv_cache
    cache.zero_()
    got = graphs.run(logits, h, tokens, roots, table)
    cache_after_graph = cache.clone()
    cache.zero_()
    want = drafter.expand(logits, h, torch.tensor(tokens), torch.tensor(roots), table, block_size, 63, roots_host=roots)
    for field in ("tokens", "parents", "depths", "ancestor_mask", "scores"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(cache, cache_after_graph) and cache.abs().sum() > 0
