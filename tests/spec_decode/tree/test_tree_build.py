"""Draft tree construction against a plain-Python beam over token paths, the ancestor mask
against a walk up the parents, topk=1 against the greedy chain, and bad shapes refused."""

from __future__ import annotations

import random

import pytest
import torch

from foretell.spec_decode.tree.build import TreeBuilder, build_tree
from foretell.spec_decode.tree.shape import TreeShape, ancestor_mask_from_parents

VOCAB = 13


def _path_logits(seed: int, path: tuple[int, ...]) -> torch.Tensor:  # [VOCAB]: the draft's logits after a path
    gen = torch.Generator().manual_seed(hash((seed,) + path) % (2**31))
    return torch.randn(VOCAB, generator=gen) * 2


def _reference_tree(seed: int, shape: TreeShape) -> dict[tuple[int, ...], float]:
    """The kept paths (root excluded) and their log path probabilities, by a beam over paths."""
    def children(path, score):
        logp = torch.log_softmax(_path_logits(seed, path).double(), -1)
        best = sorted(range(VOCAB), key=lambda t: -float(logp[t]))[: shape.topk]
        return [(path + (t,), score + float(logp[t])) for t in best]

    pool = children((), 0.0)
    frontier = list(pool)
    for _ in range(shape.depth - 1):
        candidates = [c for path, score in frontier for c in children(path, score)]
        pool += candidates
        frontier = sorted(candidates, key=lambda c: -c[1])[: shape.topk]
    kept = sorted(pool, key=lambda c: -c[1])[: shape.num_draft_tokens - 1]
    return dict(kept)


def _build(seeds: list[int], shape: TreeShape):
    """build_tree driven by a drafter that knows each frontier node's path only through the
    builder's parent slots (a wrong slot drafts from the wrong path)."""
    batch = len(seeds)
    frontier_paths = [[()] for _ in seeds]

    def logits_for(paths_per_seq):  # [B, n, VOCAB]
        return torch.stack([torch.stack([_path_logits(s, p) for p in paths]) for s, paths in zip(seeds, paths_per_seq)])

    def draft_step(tokens, parent_slot, depth):
        nonlocal frontier_paths
        frontier_paths = [[paths[int(slot)] + (int(tok),) for tok, slot in zip(toks, slots)]
                          for paths, toks, slots in zip(frontier_paths, tokens, parent_slot)]
        assert all(len(p) == depth for paths in frontier_paths for p in paths)
        return logits_for(frontier_paths)

    root_tokens = torch.arange(batch, dtype=torch.int64) + 100
    return build_tree(shape, root_tokens, logits_for(frontier_paths)[:, 0], draft_step)


def _paths(tree, b):
    paths = {0: ()}
    for i in range(1, tree.num_nodes):
        parent = int(tree.parents[b, i])
        assert 0 <= parent < i, "nodes must be topologically ordered"
        paths[i] = paths[parent] + (int(tree.tokens[b, i]),)
    return paths


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 6), TreeShape(4, 3, 10), TreeShape(5, 4, 16),
                                   TreeShape(2, 4, 21), TreeShape(6, 2, 8), TreeShape(3, 3, 4)], ids=str)
def test_tree_matches_beam_reference(shape):
    seeds = [random.randrange(2**31) for _ in range(3)]
    tree = _build(seeds, shape)
    assert tree.tokens.shape == (3, shape.num_draft_tokens)
    for b, seed in enumerate(seeds):
        expected = _reference_tree(seed, shape)
        paths = _paths(tree, b)
        assert int(tree.tokens[b, 0]) == 100 + b and int(tree.parents[b, 0]) == -1
        got = {paths[i]: float(tree.scores[b, i]) for i in range(1, tree.num_nodes)}
        assert set(got) == set(expected), f"seed {seed}"
        for path, score in got.items():
            assert score == pytest.approx(expected[path], abs=1e-4)
        for i in range(tree.num_nodes):
            assert int(tree.depths[b, i]) == len(paths[i])
            ancestors = {j for j in range(tree.num_nodes) if paths[i][: len(paths[j])] == paths[j]}
            assert {j for j in range(tree.num_nodes) if tree.ancestor_mask[b, i, j]} == ancestors
        # siblings best first: the order verification tries them in
        for i in range(1, tree.num_nodes):
            for j in range(i + 1, tree.num_nodes):
                if tree.parents[b, i] == tree.parents[b, j]:
                    assert tree.scores[b, i] >= tree.scores[b, j]


def test_topk_one_is_the_greedy_chain():
    seeds = [random.randrange(2**31) for _ in range(2)]
    shape = TreeShape.chain(5)
    tree = _build(seeds, shape)
    for b, seed in enumerate(seeds):
        path = ()
        for _ in range(5):
            path += (int(_path_logits(seed, path).argmax()),)
        assert tree.tokens[b, 1:].tolist() == list(path)
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3, 4]] * 2
    assert tree.depths.tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert torch.equal(tree.ancestor_mask, torch.ones(6, 6, dtype=torch.bool).tril().expand(2, -1, -1))


def test_certain_tokens_keep_the_tree_closed():
    """A draft certain of its token (log-probability exactly 0) ties a child with its parent:
    the parent must still come first, and no kept node may lack its parent."""
    shape = TreeShape(4, 2, 7)
    certain = torch.full((1, VOCAB), -1e4)
    certain[0, 3] = 1e4
    builder = TreeBuilder(shape, torch.tensor([0]))
    builder.add_depth(certain)
    for _ in range(3):
        builder.add_depth(certain.expand(2, -1).unsqueeze(0))
    tree = builder.finish()
    parents = tree.parents[0].tolist()
    assert all(0 <= p < i for i, p in enumerate(parents) if i > 0)
    paths = set(_paths(tree, 0).values())
    assert {(3,), (3, 3), (3, 3, 3), (3, 3, 3, 3)} <= paths  # the sure chain is kept whole


def test_ancestor_mask_of_given_parents():
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 3]])
    mask = ancestor_mask_from_parents(parents, depth=3)
    expected = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 1, 3, 5}, {0, 1, 3, 6}]
    assert [{j for j in range(7) if mask[0, i, j]} for i in range(7)] == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_speculative_tokens=0, topk=1, num_draft_tokens=2), "num_speculative_tokens"),
    (dict(num_speculative_tokens=3, topk=0, num_draft_tokens=2), "topk"),
    (dict(num_speculative_tokens=3, topk=2, num_draft_tokens=1), "num_draft_tokens"),
    (dict(num_speculative_tokens=3, topk=1, num_draft_tokens=5), "at most 4"),
    (dict(num_speculative_tokens=2, topk=2, num_draft_tokens=8), "at most 7"),
    (dict(num_speculative_tokens=2.0, topk=2, num_draft_tokens=4), "num_speculative_tokens"),
])
def test_bad_shapes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeShape(**kwargs)


def test_bad_logits_are_refused():
    builder = TreeBuilder(TreeShape(2, 3, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="exceeds the draft vocabulary"):
        builder.add_depth(torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"\[2, vocab\]"):
        builder.add_depth(torch.randn(3, VOCAB))
    builder.add_depth(torch.randn(2, VOCAB))
    with pytest.raises(ValueError, match="1 of its 2 depths"):
        builder.finish()
    with pytest.raises(ValueError, match=r"\[2, 3, vocab\]"):
        builder.add_depth(torch.randn(2, 2, VOCAB))
    builder.add_depth(torch.randn(2, 3, VOCAB))
    with pytest.raises(ValueError, match="already 2 deep"):
        builder.add_depth(torch.randn(2, 3, VOCAB))
