"""KV compaction after a tree verify, against a dense per-sequence model of the cache; and the
simulated best-path acceptance against a plain walk and its rates."""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.attention.metadata import subdivide_block_table
from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.compact import apply_slot_moves, compaction_slots
from foretell.spec_decode.tree.shape import TreeShape
from foretell.spec_decode.tree.simulated import best_path, simulated_tree_accept
from foretell.spec_decode.tree.verify import verify_greedy


def _paged_batch(gen, prefix_lens, num_nodes, block_size, extra_heads=(2, 4)):
    """A cache whose every slot holds distinct values, and each sequence's block table."""
    lens = [p + num_nodes for p in prefix_lens]
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), max(blocks)), num_blocks - 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    cache = torch.randn(2, num_blocks, block_size, *extra_heads, generator=gen)
    return cache, table


def _dense(cache, table, seq, length, block_size):  # [2, length, ...]: a sequence's positions in order
    slots = [int(table[seq, p // block_size]) * block_size + p % block_size for p in range(length)]
    return cache.flatten(1, 2)[:, slots]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_compaction_matches_dense_reference(block_size):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    shape = TreeShape(4, 3, 12)
    batch, vocab = 6, 5
    tree = build_tree(shape, torch.zeros(batch, dtype=torch.int64), torch.randn(batch, vocab, generator=gen),
                      lambda t, s, d: torch.randn(batch, 3, vocab, generator=gen))
    result = verify_greedy(tree, torch.randn(batch, shape.num_draft_tokens, vocab, generator=gen))
    accepted = result.accepted_nodes.clone()
    accepted[0] = best_path(tree)[0]  # at least one long path
    prefix_lens = [int(x) for x in torch.randint(0, 40, (batch,), generator=gen)]
    cache, table = _paged_batch(gen, prefix_lens, shape.num_draft_tokens, block_size)
    before = cache.clone()
    src, dst = compaction_slots(accepted, torch.tensor(prefix_lens), table, block_size)
    assert src.shape == dst.shape == (batch * (shape.depth + 1),)
    apply_slot_moves(cache, src, dst)
    untouched = torch.ones(cache.shape[1] * block_size, dtype=torch.bool)
    for b, prefix in enumerate(prefix_lens):
        length = prefix + shape.num_draft_tokens
        old, new = _dense(before, table, b, length, block_size), _dense(cache, table, b, length, block_size)
        path = [int(n) for n in accepted[b] if n >= 0]
        expected = old.clone()
        for depth, node in enumerate(path):
            expected[:, prefix + depth] = old[:, prefix + node]
        assert torch.equal(new, expected), f"seed {seed}, sequence {b}"
        for depth in range(len(path)):
            p = prefix + depth
            untouched[int(table[b, p // block_size]) * block_size + p % block_size] = False
    # nothing outside the accepted positions changed
    assert torch.equal(cache.flatten(1, 2)[:, untouched], before.flatten(1, 2)[:, untouched])


def test_draft_cache_with_smaller_blocks_gets_the_same_slots():
    gen = torch.Generator().manual_seed(0)
    accepted = torch.tensor([[0, 2, 5, -1], [0, 1, 4, 7]])
    prefix = torch.tensor([13, 30])
    _, table = _paged_batch(gen, [13, 30], 8, 16)
    target = compaction_slots(accepted, prefix, table, 16)
    draft = compaction_slots(accepted, prefix, subdivide_block_table(table, 16, 4), 4)
    assert all(torch.equal(a, b) for a, b in zip(target, draft))


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
def test_fp8_cache_moves_bytes():
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 4, 8, 2, 16, generator=gen).to(torch.float8_e4m3fn)
    before = cache.view(torch.uint8).clone()
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    src, dst = compaction_slots(torch.tensor([[0, 3, 6]]), torch.tensor([5]), table, 8)
    apply_slot_moves(cache, src, dst)
    flat_before, flat_after = before.flatten(1, 2), cache.view(torch.uint8).flatten(1, 2)
    slot = lambda p: int(table[0, p // 8]) * 8 + p % 8  # noqa: E731
    assert torch.equal(flat_after[:, slot(6)], flat_before[:, slot(8)])
    assert torch.equal(flat_after[:, slot(7)], flat_before[:, slot(11)])


def test_mismatched_moves_are_refused():
    with pytest.raises(ValueError, match="src_slots"):
        apply_slot_moves(torch.zeros(2, 2, 4, 1, 8), torch.tensor([0, 1]), torch.tensor([2]))


def _walk_first_children(tree, b):
    node, path = 0, [0]
    while True:
        kids = [c for c in range(1, tree.num_nodes) if int(tree.parents[b, c]) == node]
        if not kids:
            return path
        node = kids[0]
        path.append(node)


@pytest.mark.parametrize("shape", [TreeShape(4, 2, 9), TreeShape(5, 3, 4), TreeShape.chain(3)], ids=str)
def test_simulated_acceptance_follows_the_best_path(shape):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 400, 7
    tree = build_tree(shape, torch.zeros(batch, dtype=torch.int64), torch.randn(batch, vocab, generator=gen),
                      lambda t, s, d: torch.randn(batch, shape.topk, vocab, generator=gen))
    rates = torch.linspace(0.9, 0.3, shape.depth, dtype=torch.float64)
    uniforms = (torch.arange(batch, dtype=torch.float64) + 0.5) / batch  # evenly spread
    bonus = torch.randint(0, vocab, (batch,), generator=gen)
    result = simulated_tree_accept(tree, uniforms, rates, bonus)
    for b in range(batch):
        drawn = int((rates > uniforms[b]).sum())
        path = _walk_first_children(tree, b)[: drawn + 1]
        assert [int(n) for n in result.accepted_nodes[b] if n >= 0] == path, f"seed {seed}"
        assert int(result.num_accepted[b]) == len(path) - 1
        assert result.output_tokens[b, len(path) - 1] == bonus[b]
    best_depth = (best_path(tree) >= 0).sum(1) - 1
    if bool((best_depth == shape.depth).all()):  # a full best path: the rates are met
        realized = result.accepted_per_depth().double() / batch
        torch.testing.assert_close(realized, rates, rtol=0, atol=1.5 / batch)
    with pytest.raises(ValueError, match="one per depth"):
        simulated_tree_accept(tree, uniforms, rates[:-1], bonus)
