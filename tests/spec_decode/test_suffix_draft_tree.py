"""Suffix decoding's draft trees (spec_decode/suffix_draft_tree.py) against references: topk 1 is
the chain's walk (tokens and score) in a sequence's own store and in the global cache's; larger
trees hold the likeliest continuations of an independent enumeration (each path's occurrences
recomputed from the store, its probability a product of counts), in tree order; the accepted count
of a verify's tokens; HostTreeDrafter's padded trees and their ancestor masks; a branch example."""

from __future__ import annotations

import random

import pytest
import torch

from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_draft_tree import EMPTY_TREE, TreeDraft, accepted_in_tree, draft_tree
from foretell.spec_decode.suffix_draft_walk import SEPARATOR
from foretell.spec_decode.suffix_tree import Match, SuffixIndex
from foretell.spec_decode.tree.host_drafter import HostTreeDrafter
from foretell.spec_decode.tree.shape import TreeShape, ancestor_mask_from_parents

KEY = 2


def own_index(rng: random.Random) -> tuple[SuffixIndex, Match | None]:
    """A sequence's own store and the match of its end (None: no gram to match)."""
    index = SuffixIndex(KEY, 12)
    index.extend([rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(3, 40))])
    key = index.tail_key
    return index, (index.lookup(index.tokens, key) if key in index.head else None)


def cache_index(rng: random.Random) -> tuple[SuffixIndex, Match | None]:
    """The global cache's store of several responses, and a context's match in it."""
    vocab = rng.choice([2, 3, 5])
    index = SuffixIndex(KEY, 12)
    for _ in range(rng.randint(1, 5)):
        index.append_sequence([rng.randrange(vocab) for _ in range(rng.randint(1, 20))])
    context = [rng.randrange(vocab) for _ in range(6)]
    key = (context[-2] << 24) | context[-1]
    return index, (index.lookup(context, key) if key in index.head else None)


@pytest.mark.parametrize("store", [own_index, cache_index])
def test_topk_one_is_the_chain_walk(store):
    rng = random.Random(3)
    checked = 0
    for _ in range(1500):
        index, match = store(rng)
        if match is None:
            continue
        depth, min_prob = rng.randint(1, 12), rng.choice([0.0, 0.1, 0.4])
        chain, score = index.draft(match, depth, min_prob)
        tree = draft_tree(index, match, depth, depth, 1, min_prob)
        assert tree.token_ids == chain and tree.score == pytest.approx(score)
        assert tree.parents == list(range(len(chain))) and tree.depths == list(range(1, len(chain) + 1))
        checked += 1
    assert checked > 500


def next_token(index: SuffixIndex, p: int, path: list[int]) -> int:
    """The token at store position p, reading on in the path past a sequence's own end."""
    if p < index.end:
        return index.tokens[p - index.base]
    if index.many_sequences or p - index.end >= len(path):
        return SEPARATOR
    return path[p - index.end]


def enumerate_tree(index: SuffixIndex, match: Match, depth: int, topk: int, min_prob: float) -> dict:
    """Every node the pruned trie holds: path (tuple) -> probability. A path's occurrences are the
    match's positions whose next tokens spell it (recomputed from the store for each path); its
    children are its topk most frequent next tokens (ties: the most recent), kept at >= min_prob."""
    nodes = {}

    def visit(path: list[int], prob: float) -> None:
        live = [p for p in match.positions
                if all(next_token(index, p + j, path) == t for j, t in enumerate(path))]
        following = [(next_token(index, p + len(path), path), rank) for rank, p in enumerate(live)]
        counts: dict[int, tuple[int, int]] = {}
        for token, rank in following:
            if token != SEPARATOR:
                counts[token] = (counts.get(token, (0, 0))[0] + 1, rank)
        total = sum(c for c, _ in counts.values())
        for token, (count, _) in sorted(counts.items(), key=lambda item: item[1], reverse=True)[:topk]:
            child = prob * count / total
            if child >= min_prob:
                nodes[tuple(path + [token])] = child
                if len(path) + 1 < depth:
                    visit(path + [token], child)

    visit([], 1.0)
    return nodes


@pytest.mark.parametrize("store", [own_index, cache_index])
@pytest.mark.parametrize("topk", [2, 3])
def test_trees_hold_the_likeliest_continuations_in_tree_order(store, topk):
    rng = random.Random(topk)
    compared = 0
    for _ in range(800):
        index, match = store(rng)
        if match is None:
            continue
        depth, max_nodes, min_prob = rng.randint(1, 6), rng.randint(1, 12), rng.choice([0.0, 0.05, 0.3])
        tree = draft_tree(index, match, depth, max_nodes, topk, min_prob)
        every = enumerate_tree(index, match, depth, topk, min_prob)
        paths = []
        nodes = zip(tree.token_ids, tree.parents, tree.depths, tree.probs)
        for i, (token, parent, node_depth, prob) in enumerate(nodes):
            assert 0 <= parent <= i  # topological: the parent (1-based; 0 the root) comes first
            path = (paths[parent - 1] if parent else ()) + (token,)
            paths.append(path)
            assert node_depth == len(path) <= depth
            assert every[path] == pytest.approx(prob)  # a node of the pruned trie, its probability
        siblings: dict[int, list[float]] = {}
        for parent, prob in zip(tree.parents, tree.probs):
            siblings.setdefault(parent, []).append(prob)
        assert all(len(s) <= topk and s == sorted(s, reverse=True) for s in siblings.values())
        assert len(set(paths)) == len(paths) == min(max_nodes, len(every))
        if len(every) > max_nodes:  # the max_nodes likeliest (any of those tied at the cut)
            cut = sorted(every.values(), reverse=True)[max_nodes - 1]
            assert {p for p, q in every.items() if q > cut + 1e-12} <= set(paths)
            assert set(paths) <= {p for p, q in every.items() if q >= cut - 1e-12}
            compared += 1
    assert compared > 100


def test_competing_continuations_branch():
    index = SuffixIndex(KEY, 8)
    index.extend([1, 2, 3, 7, 9, 4, 1, 2, 3, 8, 9, 6, 1, 2, 3, 7, 9, 0, 1, 2, 3])  # 1 2 3: 7, 8, 7
    match = index.lookup(index.tokens, index.tail_key)
    assert match.length == 3 and len(match.positions) == 3
    tree = draft_tree(index, match, 3, 6, 2, 0.1)
    # 7 (2 of 3), its 9 (both go on with 9: 2/3 still), then the competing 8 (1 of 3) beside the 7
    assert tree.token_ids[:3] == [7, 9, 8] and tree.parents[:3] == [0, 1, 0]
    assert tree.probs[:3] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert tree.depth == 3 and tree.score == pytest.approx(sum(tree.probs))
    chain = draft_tree(index, match, 3, 6, 1, 0.1)
    assert chain.token_ids == [7, 9, 0]  # the chain follows the likelier branch only


def test_accepted_in_tree_follows_the_emitted_tokens():
    # root -> 7 (1) -> 9 (3) ; root -> 8 (2) -> 9 (4) -> 1 (5)
    tree = TreeDraft([7, 8, 9, 9, 1], [0, 0, 1, 2, 4], [1, 1, 2, 2, 3], [0.6, 0.3, 0.6, 0.3, 0.3])
    assert accepted_in_tree(tree, [8, 9, 1, 4]) == 3  # the second branch whole, then the target's token
    assert accepted_in_tree(tree, [7, 9, 5]) == 2
    assert accepted_in_tree(tree, [8, 5]) == 1
    assert accepted_in_tree(tree, [5]) == 0 and accepted_in_tree(tree, [7]) == 0  # (the last is the target's)
    assert accepted_in_tree(EMPTY_TREE, [3, 4]) == 0


class FakeBatch:
    def __init__(self, next_token_ids):
        self.next_token_ids = next_token_ids


class FakeProposer:
    def __init__(self, drafts):
        self.drafts = drafts

    def propose_drafts(self, batch):
        return self.drafts


def test_host_tree_drafter_pads_with_copies_of_the_last_leaf():
    shape = TreeShape(3, 2, 7)
    small = TreeDraft([7, 8, 9], [0, 0, 1], [1, 1, 2], [0.5, 0.4, 0.5])
    full = TreeDraft([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 2, 3], [1, 1, 2, 2, 2, 3], [0.5, 0.3, 0.3, 0.2, 0.2, 0.1])
    empty = TreeDraft([], [], [], [])
    drafter = HostTreeDrafter(FakeProposer([small, empty, full, small]), shape, torch.device("cpu"))
    picked, tree, host = drafter.draft(FakeBatch([40, 41, 42, 43]), [0, 1, 2])  # the 4th may not draft
    assert picked == [0, 2]
    assert host == torch.cat([tree.tokens, tree.depths], 1).tolist()  # the host's copy, nothing read back
    assert tree.tokens.tolist() == [[40, 7, 8, 9, 9, 9, 9], [42, 1, 2, 3, 4, 5, 6]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 1, 1, 1], [-1, 0, 0, 1, 1, 2, 3]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 2, 2, 2, 3]]
    assert torch.equal(tree.ancestor_mask, ancestor_mask_from_parents(tree.parents, 3))
    assert tree.ancestor_mask[0, 4].tolist() == [True, True, False, False, True, False, False]
    assert tree.scores[0, 3].item() == pytest.approx(torch.log(torch.tensor(0.5)).item())
    assert drafter.draft(FakeBatch([1]), []) == ([], None, [])
    too_big = HostTreeDrafter(FakeProposer([full]), TreeShape(3, 2, 4), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="does not fit num_draft_tokens=4"):
        too_big.draft(FakeBatch([1]), [0])


def draft_batch(history: list[int], k: int) -> DraftBatch:
    empty = torch.empty(0)
    return DraftBatch(
        start_positions=[len(history) - 2], num_valid_rows=[1], next_token_ids=[history[-1]], samples=[True],
        token_ids=empty, hidden_states=empty, aux_hidden_states=[], block_table=empty, block_size=16,
        sampling_params=[None], sample_indices=[0], max_model_len=1000, histories=[history], seq_ids=[5],
    )


def test_the_proposer_drafts_trees_and_judges_them_by_their_accepted_path():
    settings = SuffixSettings(max_tree_depth=8, min_match_length=2, topk=2, max_tree_nodes=6, min_accepted_tokens=1.0)
    proposer = SuffixProposer(3, settings)
    history = [1, 2, 3, 7, 9, 4, 1, 2, 3, 8, 9, 6, 1, 2, 3, 7, 9, 0, 1, 2, 3]
    [tree] = proposer.propose_drafts(draft_batch(history, 3))
    assert isinstance(tree, TreeDraft) and tree.token_ids[:3] == [7, 9, 8] and len(tree.token_ids) <= 6
    assert proposer.states[5].last_tree is tree
    # the verify took the second branch: 8 9, then the target's own 5
    proposer.propose_drafts(draft_batch(history + [8, 9, 5], 3))
    state = proposer.states[5]
    assert state.accepted_average == 2  # the path the tokens followed (a chain's judge would count 0)
    assert state.run_going is False  # the tree's deepest path is 3


def test_chains_stay_chains_under_topk_one():
    proposer = SuffixProposer(3, SuffixSettings(max_tree_depth=8, min_match_length=2))
    [draft] = proposer.propose_drafts(draft_batch([1, 2, 3, 7, 9, 4, 1, 2, 3, 8, 9, 6, 1, 2, 3, 7, 9, 0, 1, 2, 3], 3))
    assert not isinstance(draft, TreeDraft) and draft.token_ids[:2] == [7, 9]
