"""Simulated acceptance for draft trees (speculative_config topk > 1 with simulate_acceptance,
spec_decode/tree/simulated.py): trees shaped by rank as a calibrated draft would shape them, the
accepted path the best path cut at the drawn count, the token after it the target's argmax there.
The engine's realized mean acceptance length and per-depth acceptance meet the requested ones,
with dummy weights; every step's emitted tokens are the drafted best path then the target's
greedy token (checked against a plain engine's greedy token after each step's prefix)."""

from __future__ import annotations

import math

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.runner.tree_step import TreeStep
from foretell.spec_decode.simulated_acceptance import rates_from_config
from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.shape import TreeShape
from foretell.spec_decode.tree.simulated import best_path, rank_logprobs, simulated_tree_accept


def test_rank_logprobs_keep_the_best_rank_and_share_the_rest():
    shape = TreeShape(5, 4, 16)
    rates = rates_from_config({"mean_acceptance_length": 5.4}, 5)
    scores = rank_logprobs(shape, rates).double().exp()  # [depth, topk]
    conditional = [rates[0]] + [rates[d] / rates[d - 1] for d in range(1, 5)]
    assert (scores[:, 0] == 1).all()
    rest = 1 - torch.tensor(conditional, dtype=torch.float64)
    torch.testing.assert_close(scores[:, 1:].sum(1), rest, rtol=1e-5, atol=0)
    assert (scores[:, :-1] > scores[:, 1:]).all()  # best rank first
    zero = rank_logprobs(TreeShape(3, 2, 5), [0.5, 0.0, 0.0])
    assert torch.isfinite(zero).all()
    with pytest.raises(ValueError, match="one per depth"):
        rank_logprobs(shape, rates[:-1])


@pytest.mark.parametrize("shape", [TreeShape(5, 4, 16), TreeShape(6, 8, 32), TreeShape(3, 2, 4)], ids=str)
def test_shaped_trees_hold_the_full_best_path_of_the_drafts_top_tokens(shape):
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 16, 50
    rates = rates_from_config({"mean_acceptance_length": min(5.4, shape.depth)}, shape.depth)
    shaped = rank_logprobs(shape, rates)
    root_logits = torch.randn(batch, vocab, generator=gen) * 0.01  # nearly flat, as random weights give
    steps = []

    def step(tokens, slot, depth):
        steps.append(torch.randn(batch, shape.topk, vocab, generator=gen) * 0.01)
        return steps[-1]

    tree = build_tree(shape, torch.zeros(batch, dtype=torch.int64), root_logits, step, shaped)
    path = best_path(tree)
    want_depth = min(shape.depth, shape.num_draft_tokens - 1)
    assert ((path >= 0).sum(1) - 1 == want_depth).all()
    # the best path's tokens are the draft's own best guesses: depth 1 the root's argmax, then
    # the argmax after the frontier's first row (the best path's node is the frontier's best)
    assert torch.equal(tree.tokens.gather(1, path[:, 1:2]).squeeze(1), root_logits.argmax(-1))
    if want_depth > 1:
        assert torch.equal(tree.tokens.gather(1, path[:, 2:3]).squeeze(1), steps[0][:, 0].argmax(-1))
    with pytest.raises(ValueError, match="rank_logprobs must be"):
        build_tree(shape, torch.zeros(batch, dtype=torch.int64), root_logits, step, shaped[:-1])


def test_simulated_accept_reads_the_bonus_at_the_path_end_and_caps_it():
    shape = TreeShape(4, 2, 9)
    gen = torch.Generator().manual_seed(1)
    batch, vocab = 64, 11
    shaped = rank_logprobs(shape, [0.9, 0.8, 0.7, 0.6])
    tree = build_tree(shape, torch.zeros(batch, dtype=torch.int64), torch.randn(batch, vocab, generator=gen),
                      lambda t, s, d: torch.randn(batch, shape.topk, vocab, generator=gen), shaped)
    rates = torch.tensor([0.9, 0.8, 0.7, 0.6], dtype=torch.float64)
    uniforms = (torch.arange(batch, dtype=torch.float64) + 0.5) / batch
    target_ids = torch.randint(0, vocab, (batch, shape.num_draft_tokens), generator=gen)
    limits = torch.randint(0, 5, (batch,), generator=gen)
    result = simulated_tree_accept(tree, uniforms, rates, target_ids, limits)
    full = best_path(tree)
    for b in range(batch):
        drawn = min(int((rates > uniforms[b]).sum()), int(limits[b]))
        assert int(result.num_accepted[b]) == drawn
        assert result.accepted_nodes[b, : drawn + 1].tolist() == full[b, : drawn + 1].tolist()
        assert int(result.bonus_tokens[b]) == int(target_ids[b, full[b, drawn]])
        assert result.output_tokens[b, :drawn].tolist() == tree.tokens[b, full[b, 1: drawn + 1]].tolist()


def record_steps(monkeypatch) -> list[tuple[list[int], list[int], list[int], int, bool]]:
    """Wrap TreeStep.execute: per verified tree, (tokens through its root, the drafted best path's
    tokens, the emitted tokens, accepted count, whether max_tokens capped the step)."""
    steps = []
    original = TreeStep.execute

    def execute(self, sched):
        trees = dict(self.trees)
        results = original(self, sched)
        for item, result in zip(sched.scheduled, results):
            if not item.draft_token_ids:
                continue
            num_nodes = len(item.draft_token_ids) + 1
            root_index = item.seq.num_computed_tokens + item.num_new_tokens - num_nodes
            tree = trees[item.seq.seq_id]
            path = best_path(tree)[0]
            drafted = [int(tree.tokens[0, n]) for n in path[1:] if n >= 0 and n < num_nodes]
            steps.append((list(item.seq.token_ids[: root_index + 1]), drafted, list(result.new_token_ids),
                          result.num_accepted, item.accept_limit is not None))
        return results

    monkeypatch.setattr(TreeStep, "execute", execute)
    return steps


@pytest.mark.parametrize("length", [3.6, 2.0])
def test_engine_meets_the_requested_mean_length_with_dummy_weights(qwen3_checkpoint, eagle3_head, monkeypatch,
                                                                  length):
    steps = record_steps(monkeypatch)
    shape = {"num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 10}
    spec = {"method": "eagle3", "model": eagle3_head, **shape, "simulate_acceptance": {"mean_acceptance_length": length}}
    common = dict(dtype="float32", num_kv_blocks=256, load_format="dummy", seed=3)
    llm = LLM(qwen3_checkpoint, speculative_config=spec, **common)
    prompts = [{"prompt_token_ids": [(5 * i + 7 * j) % 200 + 3 for j in range(6 + 3 * i)]} for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=1, max_tokens=120, ignore_eos=True)]  # sampled: drawn as well
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 120 for o in outs)
    stats = llm.get_stats()
    assert stats["synthetic_acceptance"] is True
    rates = rates_from_config({"mean_acceptance_length": length}, 4)
    # the steps capped at max_tokens accept less than drawn: the uncapped ones meet the rates
    counts = [s[3] for s in steps if not s[4]]
    realized = 1 + sum(counts) / len(counts)
    assert math.isclose(realized, length, abs_tol=0.1), (realized, length)
    per_depth = [sum(c > d for c in counts) / len(counts) for d in range(4)]
    assert max(abs(a - b) for a, b in zip(per_depth, rates)) < 0.05, (per_depth, rates)
    assert math.isclose(stats["mean_acceptance_length"], length, abs_tol=0.2)
    # each step: the drafted best path's first `accepted` tokens, then the target's greedy token
    plain = LLM(qwen3_checkpoint, **common)
    prefixes = [{"prompt_token_ids": prefix + emitted[:-1]} for prefix, _, emitted, _, _ in steps]
    greedy = plain.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    for (prefix, drafted, emitted, accepted, _), want in zip(steps, greedy):
        assert len(emitted) == accepted + 1
        assert emitted[:-1] == drafted[:accepted]
        assert emitted[-1] == want.outputs[0].token_ids[0]
