"""The depth-independent tree verification (tree/path_verify.py) against the per-level walk it
replaces in the runner (tree/verify.py, kept as the reference): greedy (with accept limits),
sampled (the same draws give the same result) and simulated, on random trees of the drafted shapes
(5,4,16) and (6,8,32), random topologies with repeated sibling tokens, chains, a lone root, trees
where nothing is accepted and where a whole path is."""

from __future__ import annotations

import pytest
import torch

from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.path_verify import (
    best_path_nodes,
    result_from_on_path,
    verify_greedy_paths,
    verify_sampled_paths,
)
from foretell.spec_decode.tree.shape import DraftTree, TreeShape, ancestor_mask_from_parents
from foretell.spec_decode.tree.simulated import best_path, simulated_tree_accept
from foretell.spec_decode.tree.verify import last_node, result_from_path, verify_greedy, verify_sampled

FIELDS = ("accepted_nodes", "num_accepted", "bonus_tokens", "output_tokens")


def drafted_tree(shape: TreeShape, batch: int, vocab: int, seed: int) -> DraftTree:
    """A tree as the drafter builds it: top-k of random draft logits at every depth."""
    gen = torch.Generator().manual_seed(seed)
    roots = torch.randint(vocab, (batch,), generator=gen)

    def step(frontier, parent_slot, depth):
        return torch.randn(batch, shape.topk, vocab, generator=gen)

    return build_tree(shape, roots, torch.randn(batch, vocab, generator=gen), step)


def random_topology(batch: int, num_nodes: int, vocab: int, seed: int, max_depth: int | None = None) -> DraftTree:
    """Any topologically ordered tree (each node's parent an earlier node), tokens from a small
    vocabulary so siblings may repeat a token and paths match often."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    depths = torch.zeros(batch, num_nodes, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, num_nodes):
            while True:
                p = int(torch.randint(i, (1,), generator=gen))
                if max_depth is None or depths[b, p] < max_depth:
                    break
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
    depth = max(1, int(depths.max()))
    tokens = torch.randint(vocab, (batch, num_nodes), generator=gen)
    return DraftTree(TreeShape(depth, max(1, num_nodes - 1), max(2, num_nodes)), tokens, parents, depths,
                     ancestor_mask_from_parents(parents, depth), torch.zeros(batch, num_nodes))


def assert_same(got, want):
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), (field, getattr(got, field),
                                                                       getattr(want, field))


def reference_greedy(tree: DraftTree, target_ids: torch.Tensor, limits: torch.Tensor | None):
    """verify_greedy, then cut at the limits as the runner did before path_verify."""
    verify = verify_greedy(tree, target_ids)
    if limits is None:
        return verify
    keep = torch.arange(tree.shape.depth + 1).unsqueeze(0) <= limits.unsqueeze(1)
    path = torch.where(keep, verify.accepted_nodes, -1)
    return result_from_path(tree, path, target_ids.gather(1, last_node(path).unsqueeze(1)).squeeze(1))


def target_along_paths(tree: DraftTree, gen: torch.Generator, vocab: int, agree: float) -> torch.Tensor:
    """[B, T] argmax ids: at each node, with probability `agree`, one of its children's tokens."""
    target = torch.randint(vocab, tree.tokens.shape, generator=gen)
    for b in range(tree.tokens.shape[0]):
        for child in range(1, tree.num_nodes):
            if float(torch.rand(1, generator=gen)) < agree:
                target[b, tree.parents[b, child]] = tree.tokens[b, child]
    return target


@pytest.mark.parametrize("shape", [(5, 4, 16), (6, 8, 32), (4, 1, 5), (3, 2, 2)])
@pytest.mark.parametrize("agree", [0.0, 0.5, 0.9])
def test_greedy_equals_the_walk_on_drafted_trees(shape, agree):
    tree = drafted_tree(TreeShape(*shape), batch=6, vocab=50, seed=sum(shape))
    gen = torch.Generator().manual_seed(7)
    target = target_along_paths(tree, gen, 50, agree)
    assert_same(verify_greedy_paths(tree, target), reference_greedy(tree, target, None))
    limits = torch.randint(shape[0] + 1, (6,), generator=gen)
    assert_same(verify_greedy_paths(tree, target, limits), reference_greedy(tree, target, limits))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_the_walk_on_random_topologies_with_repeated_siblings(seed):
    tree = random_topology(batch=5, num_nodes=12, vocab=3, seed=seed)
    target = torch.randint(3, tree.tokens.shape, generator=torch.Generator().manual_seed(seed))
    assert_same(verify_greedy_paths(tree, target), reference_greedy(tree, target, None))


def test_greedy_extremes_nothing_accepted_whole_path_lone_root_and_chain():
    tree = drafted_tree(TreeShape(5, 4, 16), batch=3, vocab=40, seed=1)
    nothing = torch.full_like(tree.tokens, 40)  # a token no node holds
    got = verify_greedy_paths(tree, nothing)
    assert got.num_accepted.tolist() == [0, 0, 0]
    assert got.output_tokens[:, 0].tolist() == [40] * 3 and (got.output_tokens[:, 1:] == -1).all()
    assert_same(got, reference_greedy(tree, nothing, None))

    # The whole deepest path of each tree agreed with (and nothing beside it).
    whole = torch.full_like(tree.tokens, 40)
    for b in range(3):
        node = int(tree.depths[b].argmax())
        deepest = node
        while tree.parents[b, node] >= 0:
            whole[b, tree.parents[b, node]] = tree.tokens[b, node]
            node = int(tree.parents[b, node])
        whole[b, deepest] = 7
    got = verify_greedy_paths(tree, whole)
    assert got.num_accepted.tolist() == [int(tree.depths[b].max()) for b in range(3)]
    assert got.bonus_tokens.tolist() == [7, 7, 7]
    assert_same(got, reference_greedy(tree, whole, None))
    assert_same(verify_greedy_paths(tree, whole, torch.tensor([0, 2, 5])),
                reference_greedy(tree, whole, torch.tensor([0, 2, 5])))

    root = DraftTree(TreeShape(1, 1, 2), torch.tensor([[5], [6]]), torch.tensor([[-1], [-1]]), torch.zeros(2, 1,
                     dtype=torch.int64), torch.ones(2, 1, 1, dtype=torch.bool), torch.zeros(2, 1))
    got = verify_greedy_paths(root, torch.tensor([[3], [4]]))
    assert got.accepted_nodes.tolist() == [[0, -1], [0, -1]] and got.output_tokens.tolist() == [[3, -1], [4, -1]]
    assert_same(got, reference_greedy(root, torch.tensor([[3], [4]]), None))

    chain = drafted_tree(TreeShape.chain(4), batch=2, vocab=30, seed=3)
    target = torch.cat([chain.tokens[:, 1:], torch.tensor([[9], [9]])], 1)
    target[1, 2] = 29 if chain.tokens[1, 3] != 29 else 28  # the second chain stops after two
    got = verify_greedy_paths(chain, target)
    assert got.num_accepted.tolist() == [4, 2]
    assert_same(got, reference_greedy(chain, target, None))


@pytest.mark.parametrize("shape", [(5, 4, 16), (6, 8, 32), (3, 1, 4)])
@pytest.mark.parametrize("sharp", [0.5, 4.0])
def test_sampled_equals_the_walk_with_the_same_draws(shape, sharp):
    vocab, batch = 24, 7
    tree = drafted_tree(TreeShape(*shape), batch=batch, vocab=vocab, seed=shape[2])
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(batch, shape[2], vocab, generator=gen) * sharp
    # Steer some rows toward their first child so long paths are accepted too.
    for b in range(batch):
        for child in range(1, shape[2]):
            logits[b, tree.parents[b, child], tree.tokens[b, child]] += sharp * (1 + b % 3)
    probs = torch.softmax(logits, -1)
    for seed in range(3):
        want = verify_sampled(tree, probs, None, torch.Generator().manual_seed(seed))
        draws = torch.Generator().manual_seed(seed)  # the reference's draws, in its order
        uniforms = torch.rand(tree.tokens.shape, generator=draws, dtype=probs.dtype)
        noise = torch.empty(batch, vocab, dtype=probs.dtype).exponential_(generator=draws)
        assert_same(verify_sampled_paths(tree, probs, uniforms, noise), want)


def test_sampled_first_accepted_sibling_wins_and_bad_draws_are_refused():
    tree = random_topology(batch=4, num_nodes=10, vocab=2, seed=5, max_depth=3)  # repeated sibling tokens
    probs = torch.softmax(torch.randn(4, 10, 6, generator=torch.Generator().manual_seed(2)), -1)
    for seed in range(4):
        want = verify_sampled(tree, probs, None, torch.Generator().manual_seed(seed))
        draws = torch.Generator().manual_seed(seed)
        uniforms = torch.rand(tree.tokens.shape, generator=draws)
        noise = torch.empty(4, 6).exponential_(generator=draws)
        assert_same(verify_sampled_paths(tree, probs, uniforms, noise), want)
    with pytest.raises(ValueError, match="uniforms"):
        verify_sampled_paths(tree, probs, torch.rand(4, 9), torch.ones(4, 6))
    with pytest.raises(ValueError, match="noise"):
        verify_sampled_paths(tree, probs, torch.rand(4, 10), torch.ones(4, 5))
    with pytest.raises(ValueError, match="one row per tree node"):
        verify_greedy_paths(tree, torch.zeros(4, 9, dtype=torch.int64))


@pytest.mark.parametrize("shape", [(5, 4, 16), (6, 8, 32), (4, 1, 5)])
def test_simulated_best_path_equals_the_walk(shape):
    tree = drafted_tree(TreeShape(*shape), batch=8, vocab=40, seed=2)
    gen = torch.Generator().manual_seed(4)
    drawn = torch.randint(shape[0] + 1, (8,), generator=gen)
    keep = torch.arange(shape[0] + 1).unsqueeze(0) <= drawn.unsqueeze(1)
    path = torch.where(keep, best_path(tree), -1)
    target = torch.randint(40, tree.tokens.shape, generator=gen)
    want = result_from_path(tree, path, target.gather(1, last_node(path).unsqueeze(1)).squeeze(1))
    assert_same(result_from_on_path(tree, best_path_nodes(tree, drawn), want.bonus_tokens), want)
    # simulated_tree_accept (now on best_path_nodes): rates all 1 take the whole best path, cut at the limits.
    rates = torch.ones(shape[0], dtype=torch.float64)
    got = simulated_tree_accept(tree, torch.full((8,), 0.5, dtype=torch.float64), rates, target, drawn)
    assert_same(got, want)
