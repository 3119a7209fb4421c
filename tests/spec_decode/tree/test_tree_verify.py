"""Tree verification: greedy against a plain walk, and multi-draft rejection sampling's output
distribution against the target's, by exact enumeration in float64 (fixed top-k drafts, and
children drawn from their draft distributions, every draw enumerated) and by chi-square on samples.

The target is consistent: its distribution after a path depends on the path's tokens only
(`Target`), so the joint law of the first two emitted tokens can be checked: when a step emits one
token, the second is what the next step's target would draw after it.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.shape import DraftTree, TreeShape, ancestor_mask_from_parents
from foretell.spec_decode.tree.verify import node_acceptance, verify_greedy, verify_sampled

VOCAB = 4


class Target:
    """A random next-token distribution per path (float64), fixed by the seed."""

    def __init__(self, seed: int, vocab: int = VOCAB, sharpness: float = 1.5):
        self.seed, self.vocab, self.sharpness = seed, vocab, sharpness
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, path: tuple[int, ...]) -> torch.Tensor:  # [vocab] float64
        if path not in self._rows:
            gen = torch.Generator().manual_seed(hash((self.seed,) + path) % (2**31))
            logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.sharpness
            self._rows[path] = torch.softmax(logits, -1)
        return self._rows[path]


def _tree(tokens: list[list[int]], parents: list[int], topk: int) -> DraftTree:
    """B trees of one structure (parents), each with its own tokens (node 0 the root)."""
    batch, num_nodes = len(tokens), len(parents)
    parent_t = torch.tensor(parents).expand(batch, -1).clone()
    depths = [0] * num_nodes
    for i in range(1, num_nodes):
        depths[i] = depths[parents[i]] + 1
    shape = TreeShape(max(depths), topk, num_nodes)
    return DraftTree(shape, torch.tensor(tokens), parent_t, torch.tensor(depths).expand(batch, -1).clone(),
                     ancestor_mask_from_parents(parent_t, max(depths)), torch.zeros(batch, num_nodes))


def _paths(tree: DraftTree, b: int) -> list[tuple[int, ...]]:
    paths = [()]
    for i in range(1, tree.num_nodes):
        paths.append(paths[int(tree.parents[b, i])] + (int(tree.tokens[b, i]),))
    return paths


def _rows_by_path(tree: DraftTree, structure: list[int], law, parents_law: bool = False) -> torch.Tensor:
    """[B, T, V]: law(path of node t) (or law(its parent's path)), vectorised over B trees of one
    structure."""
    batch, num_nodes = tree.tokens.shape
    out = torch.empty(batch, num_nodes, VOCAB, dtype=torch.float64)
    for node in range(num_nodes):
        chain = []
        n = node
        while n > 0:
            chain.insert(0, n)
            n = structure[n]
        if parents_law:
            chain = chain[:-1]
        if not chain:
            out[:, node] = law(())
            continue
        paths = tree.tokens[:, chain]  # [B, len]
        unique, inverse = torch.unique(paths, dim=0, return_inverse=True)
        table = torch.stack([law(tuple(p)) for p in unique.tolist()])
        out[:, node] = table[inverse]
    return out


def _target_rows(tree: DraftTree, target: Target) -> torch.Tensor:  # [B, T, V] float64
    return torch.stack([torch.stack([target(p) for p in _paths(tree, b)]) for b in range(tree.tokens.shape[0])])


# A root with 3 children (topk 3); the first has 2 children, one of which has a child.
STRUCTURE = [-1, 0, 0, 0, 1, 1, 4]


def _two_token_law(tree: DraftTree, b: int, accept, residual, target: Target) -> torch.Tensor:
    """[V, V] float64: P(first two tokens emitted = x1, x2), a step emitting one token completed by
    the next step's target draw."""
    children = {n: [c for c in range(1, tree.num_nodes) if int(tree.parents[b, c]) == n] for n in range(tree.num_nodes)}
    paths = _paths(tree, b)

    def first_token(node):  # [V]: the law of the first token a step emits from `node` on
        law, reach = torch.zeros(VOCAB, dtype=torch.float64), 1.0
        for c in children[node]:
            law[int(tree.tokens[b, c])] += reach * accept[b, c]
            reach = reach * (1 - accept[b, c])
        return law + reach * residual[b, node]

    law, reach = torch.zeros(VOCAB, VOCAB, dtype=torch.float64), 1.0
    for c in children[0]:
        law[int(tree.tokens[b, c])] += reach * accept[b, c] * first_token(c)
        reach = reach * (1 - accept[b, c])
    for x1 in range(VOCAB):
        law[x1] += reach * residual[b, 0, x1] * target((x1,))
    return law


def _expected_two_token_law(target: Target) -> torch.Tensor:  # [V, V]
    root = target(())
    return torch.stack([root[x] * target((x,)) for x in range(VOCAB)])


def test_exact_law_with_fixed_topk_drafts():
    """Any fixed tree of distinct sibling tokens (one-hot q): the emitted tokens follow the target."""
    seed = random.randrange(2**31)
    target = Target(seed)
    rng = random.Random(seed)
    trees = []
    for _ in range(20):
        root_children = rng.sample(range(VOCAB), 3)
        grandchildren = rng.sample(range(VOCAB), 2)
        trees.append([0] + root_children + grandchildren + [rng.randrange(VOCAB)])
    tree = _tree(trees, STRUCTURE, topk=3)
    accept, residual = node_acceptance(tree, _target_rows(tree, target))
    expected = _expected_two_token_law(target)
    for b in range(len(trees)):
        law = _two_token_law(tree, b, accept, residual, target)
        torch.testing.assert_close(law, expected, rtol=0, atol=1e-12, msg=lambda m: f"seed {seed}, tree {b}: {m}")


def test_exact_law_with_sampled_drafts():
    """Children drawn independently from their draft distributions (repeats allowed, as SpecInfer):
    averaged over every possible draw, weighted by its probability, the law is the target's."""
    seed = random.randrange(2**31)
    target = Target(seed)
    draft = Target(seed + 1, sharpness=1.0)  # q after each path
    structure = [-1, 0, 0, 1, 1]  # root: 2 children; the first: 2 children
    tokens, weights = [], []
    for a, b_, c, d in itertools.product(range(VOCAB), repeat=4):
        tokens.append([0, a, b_, c, d])
        weights.append(float(draft(())[a] * draft(())[b_] * draft((a,))[c] * draft((a,))[d]))
    tree = _tree(tokens, structure, topk=2)
    q = torch.stack([torch.stack([draft(p[:-1]) if p else draft(()) for p in _paths(tree, b)])
                     for b in range(len(tokens))])  # row t: the law node t was drawn from
    accept, residual = node_acceptance(tree, _target_rows(tree, target), q)
    law = sum(w * _two_token_law(tree, b, accept, residual, target) for b, w in enumerate(weights))
    torch.testing.assert_close(law, _expected_two_token_law(target), rtol=0, atol=1e-12,
                               msg=lambda m: f"seed {seed}: {m}")


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 5
    stat = float((((counts - expected) ** 2) / expected.clamp(min=1e-300))[keep].sum())
    dof = int(keep.sum()) - 1
    # the chi-square law's survival function: the regularized upper incomplete gamma Q(dof / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampled_verify_chi_square(sampled_drafts):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    target, draft = Target(seed), Target(seed + 1, sharpness=1.0)
    samples = 40000
    if sampled_drafts:  # every child drawn independently from the draft's law after its parent's path
        tokens = torch.zeros(samples, len(STRUCTURE), dtype=torch.int64)
        tokens[:, 1:4] = torch.multinomial(draft(()).float(), samples * 3, replacement=True,
                                           generator=gen).view(samples, 3)
        for node, parent in ((4, 1), (5, 1), (6, 4)):
            parent_path = tokens[:, [1] if parent == 1 else [1, 4]]
            for prefix in {tuple(r) for r in parent_path.tolist()}:
                rows = (parent_path == torch.tensor(prefix)).all(1)
                tokens[rows, node] = torch.multinomial(draft(prefix).float(), int(rows.sum()), replacement=True,
                                                       generator=gen)
        tokens = tokens.tolist()
    else:
        tokens = [[0, 2, 0, 3, 1, 2, 0]] * samples
    tree = _tree(tokens, STRUCTURE, topk=3)
    target_probs = _rows_by_path(tree, STRUCTURE, target).float()
    q = _rows_by_path(tree, STRUCTURE, draft, parents_law=True).float() if sampled_drafts else None
    result = verify_sampled(tree, target_probs, q, generator=gen)
    first = result.output_tokens[:, 0]
    second = result.output_tokens[:, 1].clone()
    ended = second < 0  # one token emitted: the next step's target draws the second
    for x1 in range(VOCAB):
        rows = ended & (first == x1)
        second[rows] = torch.multinomial(target((x1,)).float(), int(rows.sum()), replacement=True, generator=gen) \
            if rows.any() else second[rows]
    pairs = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double()
    p_value = _chi_square(pairs, _expected_two_token_law(target).flatten())
    assert p_value > 1e-4, f"seed {seed}: chi-square p = {p_value}"
    # the tree is used, not bypassed: with fixed drafts the root's children (tokens 2, 0, 3) are accepted
    # with probability 1 - p(1); with sampled drafts the first child alone is accepted with probability
    # sum(min(p, q)), a lower bound for accepting any
    accepted_rate = float((result.num_accepted > 0).double().mean())
    p_root = target(())
    expected = float(torch.minimum(p_root, draft(())).sum()) if sampled_drafts else 1 - float(p_root[1])
    five_sigma = 5 * (expected * (1 - expected) / samples) ** 0.5 + 1e-9
    if sampled_drafts:
        assert accepted_rate >= expected - five_sigma, f"seed {seed}: {accepted_rate} < {expected}"
    else:
        assert abs(accepted_rate - expected) <= five_sigma, f"seed {seed}: {accepted_rate} vs {expected}"


def _greedy_reference(tree: DraftTree, argmax: torch.Tensor, b: int) -> list[int]:
    node, path = 0, [0]
    while True:
        nxt = [c for c in range(1, tree.num_nodes)
               if int(tree.parents[b, c]) == node and int(tree.tokens[b, c]) == int(argmax[b, node])]
        if not nxt:
            return path
        node = nxt[0]
        path.append(node)


def test_greedy_longest_matching_path():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    vocab, batch = 5, 64
    shape = TreeShape(4, 3, 12)
    tree = build_tree(shape, torch.zeros(batch, dtype=torch.int64), torch.randn(batch, vocab, generator=gen),
                      lambda t, s, d: torch.randn(batch, 3, vocab, generator=gen))
    # A target that often agrees with the draft's first choices
    logits = torch.randn(batch, shape.num_draft_tokens, vocab, generator=gen)
    result = verify_greedy(tree, logits)
    argmax = logits.argmax(-1)
    for b in range(batch):
        path = _greedy_reference(tree, argmax, b)
        a = len(path) - 1
        assert result.accepted_nodes[b, : a + 1].tolist() == path and (result.accepted_nodes[b, a + 1:] == -1).all()
        assert int(result.num_accepted[b]) == a
        assert int(result.bonus_tokens[b]) == int(argmax[b, path[-1]])
        assert result.output_tokens[b, : a + 1].tolist() == [int(tree.tokens[b, n]) for n in path[1:]] + [int(argmax[b, path[-1]])]
    assert result.num_accepted.max() >= 2, f"seed {seed}: no deep path exercised"
    counts = result.accepted_per_depth()
    assert counts.tolist() == [int((result.num_accepted > d).sum()) for d in range(shape.depth)]


def test_greedy_chain_matches_chain_rule():
    """topk 1: accept the longest prefix of drafts equal to the target's argmax, then its argmax."""
    tokens = torch.tensor([[7, 1, 2, 3], [7, 1, 2, 3], [7, 4, 2, 3]])
    parents = torch.tensor([[-1, 0, 1, 2]] * 3)
    tree = DraftTree(TreeShape.chain(3), tokens, parents, torch.arange(4).expand(3, -1), ancestor_mask_from_parents(parents, 3),
                     torch.zeros(3, 4))
    argmax = torch.tensor([[1, 2, 3, 9], [1, 2, 5, 9], [1, 2, 3, 9]])
    result = verify_greedy(tree, argmax)
    assert result.num_accepted.tolist() == [3, 2, 0]
    assert result.output_tokens.tolist() == [[1, 2, 3, 9], [1, 2, 5, -1], [1, -1, -1, -1]]


def test_bad_rows_are_refused():
    tree = _tree([[0, 1, 2]], [-1, 0, 0], topk=2)
    with pytest.raises(ValueError, match="one row per tree node"):
        verify_greedy(tree, torch.randn(1, 2, VOCAB))
    with pytest.raises(ValueError, match="draft_probs"):
        node_acceptance(tree, torch.rand(1, 3, VOCAB), torch.rand(1, 3, VOCAB + 1))
