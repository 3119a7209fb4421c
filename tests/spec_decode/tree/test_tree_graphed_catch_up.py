"""The tree step's catch-up after a graphed verify (issue 28): each sequence's accepted path padded to
depth + 1 rows (ModelTreeDrafter.padded_catch_up), run with the expansion as one replay of the
drafter's graph (TreeDraftGraphs.run_after_verify) before the step's host read.

Held here against independent references: the padded catch-up gives the eager catch-up's
(Eagle3Proposer.catch_up over the unpadded path rows) draft logits, EAGLE3 state and draft K/V
within float32 rounding, whatever each sequence accepted, and leaves every other slot of the draft
cache alone but the padded rows' own (which the expansion's scratch rewrites); with the shipped
default family (whose head accepts: paths longer than the root) float32 greedy trees equal plain
greedy with the catch-up on the graph buffers, and steps it cannot serve (near max_model_len, a
request with logprobs) catch up the usual way."""

from __future__ import annotations

import os

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.spec_decode.proposer import DraftBatch
from test_tree_engine import greedy, ids, targets, tree_llm, llama31_eagle3_head  # noqa: F401 (fixtures)
from test_tree_graphs import graphed

DEFAULTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "foretell", "default_models")


def _slots(table: torch.Tensor, positions: list[int], block_size: int) -> list[int]:
    return [int(table[p // block_size]) * block_size + p % block_size for p in positions]


@pytest.mark.parametrize("accepted", [[0, 2, 3], [3, 3, 3], [0, 0, 0]], ids=str)
def test_padded_catch_up_equals_the_eager_catch_up(targets, accepted):
    target, head = targets["llama31"]
    runner = tree_llm(target, head).engine.runner
    drafter = runner.tree_step.drafter
    eagle = drafter.proposer
    depth, block_size, max_model_len = drafter.shape.depth, runner.cache_plan.block_size, 64
    rows_per_seq, n = depth + 1, len(accepted)
    gen = torch.Generator().manual_seed(sum(accepted))
    first_pos = [9, 20, 33]
    # [n, 8]: each sequence its own blocks (the block manager never gives two the blocks past their tokens)
    table = torch.randperm(8 * n, generator=gen, dtype=torch.int32).view(n, 8)
    features = torch.randn(n * rows_per_seq, eagle.head.fc.weight.shape[1], generator=gen)  # [n * (depth + 1), F]
    path_tokens = torch.randint(1, 200, (n, depth + 2), generator=gen)  # [n, depth + 2]
    for b, a in enumerate(accepted):
        path_tokens[b, a + 2:] = -1  # output tokens past the bonus
    cache = eagle.kv_layers()[0].kv_cache
    cache.normal_(generator=gen)
    before = cache.clone()

    live = torch.ones(n, dtype=torch.bool)
    logits, h, next_roots, roots = drafter.padded_catch_up(
        features, path_tokens, torch.tensor(accepted), torch.tensor(first_pos), live, table, block_size,
        max_model_len - 1, first_pos_host=first_pos)
    padded_cache = cache.clone()

    # The reference: the chain's catch-up over each sequence's path rows alone (v = 1 + accepted).
    cache.copy_(before)
    rows = [b * rows_per_seq + r for b, a in enumerate(accepted) for r in range(a + 1)]
    width = features.shape[1] // 3
    batch = DraftBatch(
        start_positions=first_pos, num_valid_rows=[a + 1 for a in accepted],
        next_token_ids=[int(path_tokens[b, a + 1]) for b, a in enumerate(accepted)], samples=[True] * n,
        token_ids=torch.tensor([int(path_tokens[b, r]) for b, a in enumerate(accepted) for r in range(a + 1)]),
        hidden_states=torch.zeros(len(rows), width),
        aux_hidden_states=[features[rows, i * width: (i + 1) * width] for i in range(3)],
        block_table=table, block_size=block_size, sampling_params=[greedy()] * n, sample_indices=[0] * n,
        max_model_len=max_model_len)
    want_logits, want_h = eagle.catch_up(batch, list(range(n)))

    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    assert next_roots.tolist() == batch.next_token_ids
    assert roots.tolist() == [batch.num_tokens_after_step(b) - 1 for b in range(n)]
    flat_padded, flat_eager, flat_before = (c.flatten(1, 2) for c in (padded_cache, cache, before))  # [2, slots, ..]
    written, padding = [], []
    for b, (p0, a) in enumerate(zip(first_pos, accepted)):
        path = _slots(table[b], list(range(p0, p0 + a + 1)), block_size)
        written += path
        padding += _slots(table[b], list(range(p0 + a + 1, p0 + rows_per_seq)), block_size)
        torch.testing.assert_close(flat_padded[:, path], flat_eager[:, path], rtol=1e-5, atol=1e-5)
        assert not torch.equal(flat_padded[:, path], flat_before[:, path])
    untouched = torch.ones(flat_before.shape[1], dtype=torch.bool)
    untouched[written + padding] = False
    assert torch.equal(flat_padded[:, untouched], flat_before[:, untouched])
    assert torch.equal(flat_eager[:, untouched], flat_before[:, untouched])


def test_padded_catch_up_of_padding_sequences_writes_nothing(targets):
    """A bucket's padding sequences (live False): slot -1 on every row (what a graph-safe backend
    skips); their outputs are finite and unused."""
    from foretell.ops.step.reference import catch_up_rows_torch

    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    _, _, slots = catch_up_rows_torch(torch.zeros(2, 4, dtype=torch.int64), torch.tensor([3, 5]),
                                      torch.tensor([1, 0]), torch.tensor([7, 8]), torch.tensor([True, False]),
                                      table, 4, 4, 1, 63)
    assert (slots[1] == -1).all() and (slots[0] >= 0).all()


@pytest.fixture(scope="module")
def family() -> tuple[str, str]:
    target, head = os.path.join(DEFAULTS, "qwen3-target"), os.path.join(DEFAULTS, "qwen3-eagle3")
    if not os.path.isfile(os.path.join(head, "model.safetensors")):
        pytest.skip("the shipped default family is not in this checkout")
    return target, head


PROMPTS = ["Question: Tom has 3 apples and buys 5 more. How many apples does he have? Answer:",
           "Question: A train travels 60 miles in 2 hours. What is its speed? Answer:"]


def test_graphed_catch_up_with_real_acceptance_equals_plain(family):
    target, head = family
    params = greedy(24)
    want = ids(LLM(target, dtype="float32", num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False))
    llm = graphed(tree_llm(target, head, {"num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 10},
                           num_kv_blocks=64))
    assert ids(llm.generate(PROMPTS, params, use_tqdm=False)) == want
    graphs = llm.engine.runner.tree_step.drafter.graphs
    assert graphs.num_caught_up > 0
    assert llm.get_stats()["mean_acceptance_length"] > 1.3  # paths below the root were caught up


def test_steps_the_graphed_catch_up_cannot_serve_catch_up_the_usual_way(family):
    """Near max_model_len (no room for the padded rows and a draft) and with a logprobs request in
    the step, the catch-up runs eagerly after the read; outputs stay plain greedy's."""
    target, head = family
    plain = LLM(target, dtype="float32", num_kv_blocks=64, max_model_len=48)
    tree = {"num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 10}
    llm = graphed(tree_llm(target, head, tree, num_kv_blocks=64, max_model_len=48))
    params = greedy(None)
    assert ids(llm.generate(PROMPTS, params, use_tqdm=False)) == ids(plain.generate(PROMPTS, params, use_tqdm=False))
    graphs = llm.engine.runner.tree_step.drafter.graphs
    assert 0 < graphs.num_caught_up < graphs.num_runs + 1  # some steps on the buffers, the last ones not
    caught_up = graphs.num_caught_up
    with_logprobs = [greedy(8), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)]
    llm.generate(PROMPTS, with_logprobs, use_tqdm=False)
    assert graphs.num_caught_up == caught_up  # every step held the logprobs request: none on the buffers
