"""The tree step's verify inputs (runner/tree_step.TreeStep._tree_batch): rows at root + depth from
the depths read with the drafted tokens, and the ancestor mask over each sequence's last keys: a
batch of whole trees takes the trees' masks as they are (no scatter), a batch with other rows
(a decode row, a prefill chunk) scatters them into all-true rows; both against a mask built entry
by entry from the parent arrays."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from foretell.runner.input_batch import InputBatch
from foretell.runner.tree_group import TreeGroup
from foretell.runner.tree_step import TreeStep
from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.shape import TreeShape

SHAPE = TreeShape(3, 3, 7)
BLOCK_SIZE = 4


def _trees(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return build_tree(SHAPE, torch.arange(n), torch.randn(n, 9, generator=gen),
                      lambda t, s, d: torch.randn(n, SHAPE.topk, 9, generator=gen))


def _batch(rows_per_seq: list[int], contexts: list[int]) -> InputBatch:
    positions, slots, starts, block_ids = [], [], [0], []
    for rows, context in zip(rows_per_seq, contexts):
        blocks = list(range(len(block_ids) * 20, len(block_ids) * 20 + -(-context // BLOCK_SIZE)))
        block_ids.append(blocks)
        for p in range(context - rows, context):
            positions.append(p)
            slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + rows)
    return InputBatch(token_ids=[1] * starts[-1], position_list=positions, slot_list=slots, block_ids=block_ids,
                      query_start=starts, seq_lens=contexts, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                      logits_row_ids=[], sampling_seq_index=[], row_positions=[])


def _ancestor(parents: list[int], i: int, j: int) -> bool:
    while i >= 0:
        if i == j:
            return True
        i = parents[i]
    return False


def _expected(batch: InputBatch, trees, tree_seqs: list[int], width: int):
    mask = torch.ones(batch.num_tokens, width, dtype=torch.bool)
    positions = list(batch.position_list)
    T = SHAPE.num_draft_tokens
    for j, s in enumerate(tree_seqs):
        root_row = batch.query_start[s + 1] - T
        parents, depths = trees.parents[j].tolist(), trees.depths[j].tolist()
        for i in range(T):
            positions[root_row + i] = batch.position_list[root_row] + depths[i]
            for k in range(T):
                mask[root_row + i, width - T + k] = _ancestor(parents, i, k)
    return mask, positions


def _group(batch: InputBatch, trees, tree_seqs: list[int]) -> TreeGroup:
    T = SHAPE.num_draft_tokens
    root_rows = [batch.query_start[s + 1] - T for s in tree_seqs]
    return TreeGroup(tree_seqs, trees, root_rows, [batch.position_list[r] for r in root_rows],
                     trees.depths.tolist())


def _run(batch, groups):
    step = SimpleNamespace(device=torch.device("cpu"))
    return TreeStep._tree_batch(step, batch, groups)


def test_whole_trees_take_their_masks_as_they_are():
    trees = _trees(3, seed=1)
    T = SHAPE.num_draft_tokens
    batch = _batch([T, T, T], [20, 9, 31])
    out = _run(batch, [_group(batch, trees, [0, 1, 2])])
    mask, positions = _expected(batch, trees, [0, 1, 2], T)
    assert torch.equal(out.attn_metadata.tree_mask, mask)
    assert out.position_list == positions
    assert out.attn_metadata.tree_mask.data_ptr() == trees.ancestor_mask.data_ptr()  # a view, no copy


def test_other_rows_beside_trees_get_all_true_rows():
    trees = _trees(2, seed=2)
    T = SHAPE.num_draft_tokens
    batch = _batch([1, T, 5, T], [12, 18, 5, 27])  # a decode row, a tree, a prefill chunk, a tree
    out = _run(batch, [_group(batch, trees, [1, 3])])
    mask, positions = _expected(batch, trees, [1, 3], T)
    assert torch.equal(out.attn_metadata.tree_mask, mask)
    assert out.position_list == positions
