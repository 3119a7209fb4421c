"""The tree step's K/V compaction in one launch over every layer (ops/step/kv_moves.py,
triton_kv_moves.py): the Triton kernel (Triton's interpreter on the CPU) and its torch twin against
the per-layer gather/scatter (tree/compact.apply_slot_moves) and against a dense per-sequence model
of where each path node must land, fp16 and fp32, with paths that chain (a move's source is an
earlier move's destination); and the inputs it refuses."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.step.kv_moves import KVMoveTargets, move_kv_slots, move_kv_slots_torch
from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.compact import apply_slot_moves, compaction_slots
from foretell.spec_decode.tree.shape import TreeShape
from foretell.spec_decode.tree.simulated import best_path
from foretell.spec_decode.tree.verify import verify_greedy

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernel = import_interpreted("foretell.ops.step.triton_kv_moves")


def _case(seed: int, dtype: torch.dtype, num_layers: int, block_size: int, heads=(2, 8)):
    """(layers' caches, src, dst, moves per sequence, paths, prefix lengths, block table)."""
    gen = torch.Generator().manual_seed(seed)
    shape = TreeShape(4, 3, 12)
    batch, vocab = 5, 6
    tree = build_tree(shape, torch.zeros(batch, dtype=torch.int64), torch.randn(batch, vocab, generator=gen),
                      lambda t, s, d: torch.randn(batch, 3, vocab, generator=gen))
    accepted = verify_greedy(tree, torch.randn(batch, shape.num_draft_tokens, vocab, generator=gen)).accepted_nodes
    accepted[0] = best_path(tree)[0]  # a full-depth path
    accepted[1] = torch.tensor([0, 2, 5, 8, 11])  # a chain of moves: 2 -> 1, then 5 -> 2 (2 was a source)
    prefix_lens = [int(x) for x in torch.randint(0, 30, (batch,), generator=gen)]
    blocks = [-(-(p + shape.num_draft_tokens) // block_size) for p in prefix_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((batch, max(blocks)), num_blocks - 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[used: used + n].to(torch.int32)
        used += n
    caches = [torch.randn(2, num_blocks, block_size, *heads, generator=gen).to(dtype).to(DEVICE)
              for _ in range(num_layers)]
    src, dst = compaction_slots(accepted, torch.tensor(prefix_lens), table, block_size)
    return caches, src.to(DEVICE), dst.to(DEVICE), shape.depth + 1, accepted, prefix_lens, table


def _dense_expected(cache, accepted, prefix_lens, table, block_size):
    """The cache after compaction, built position by position: node path[d] lands at prefix + d."""
    out = cache.clone()
    flat_in, flat_out = cache.flatten(1, 2), out.flatten(1, 2)

    def slot(b, p):
        return int(table[b, p // block_size]) * block_size + p % block_size
    for b, prefix in enumerate(prefix_lens):
        for d, node in enumerate(int(n) for n in accepted[b]):
            if node >= 0:
                flat_out[:, slot(b, prefix + d)] = flat_in[:, slot(b, prefix + node)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_one_launch_matches_twin_per_layer_path_and_dense_model(dtype, block_size):
    seed = random.randrange(2**31)
    caches, src, dst, moves, accepted, prefix_lens, table = _case(seed, dtype, num_layers=3, block_size=block_size)
    expected = [_dense_expected(c, accepted, prefix_lens, table, block_size) for c in caches]
    per_layer = [c.clone() for c in caches]
    for c in per_layer:
        apply_slot_moves(c, src, dst)
    twin = [c.clone() for c in caches]
    move_kv_slots_torch(KVMoveTargets(twin), src, dst)
    launched = [c.clone() for c in caches]
    kernel.move_kv_slots_triton(KVMoveTargets(launched), src, dst, moves)
    for layer in range(len(caches)):
        assert torch.equal(per_layer[layer], expected[layer]), f"seed {seed}: per-layer path, layer {layer}"
        assert torch.equal(twin[layer], expected[layer]), f"seed {seed}: twin, layer {layer}"
        assert torch.equal(launched[layer], expected[layer]), f"seed {seed}: one launch, layer {layer}"


def test_layers_in_separate_allocations_and_uneven_rows():
    """Caches that are separate tensors (offsets both sides of the first) and a row of 3 x 5 = 15
    elements (masked columns); every layer moved, nothing else touched."""
    caches, src, dst, moves, accepted, prefix_lens, table = _case(7, torch.float32, 4, 4, heads=(3, 5))
    caches = [caches[2], caches[0], caches[3], caches[1]]  # the base is not the lowest address
    expected = [_dense_expected(c, accepted, prefix_lens, table, 4) for c in caches]
    targets = KVMoveTargets(caches)
    assert targets.single_base and targets.row_elems == 15
    kernel.move_kv_slots_triton(targets, src, dst, moves)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_fp8_caches_move_as_bytes():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    caches, src, dst, moves, accepted, prefix_lens, table = _case(3, torch.float32, 2, 4)
    fp8 = [c.to(torch.float8_e4m3fn) for c in caches]
    expected = [_dense_expected(c.view(torch.uint8), accepted, prefix_lens, table, 4) for c in fp8]
    targets = KVMoveTargets(fp8)
    kernel.move_kv_slots_triton(targets, src, dst, moves)
    for got, want in zip(fp8, expected):
        assert torch.equal(got.view(torch.uint8), want)
    again = [c.clone() for c in caches]
    move_kv_slots(KVMoveTargets(again), src, dst, moves)  # the dispatch (twin off CUDA)
    for got, want in zip(again, [_dense_expected(c, accepted, prefix_lens, table, 4) for c in caches]):
        assert torch.equal(got, want)


def test_bad_inputs_are_refused():
    a = torch.zeros(2, 4, 4, 2, 8)
    with pytest.raises(ValueError, match="at least one"):
        KVMoveTargets([])
    with pytest.raises(ValueError, match="layer 1's cache"):
        KVMoveTargets([a, torch.zeros(2, 5, 4, 2, 8)])
    with pytest.raises(ValueError, match="layer 1's cache"):
        KVMoveTargets([a, torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16)])
    with pytest.raises(ValueError, match="contiguous"):
        KVMoveTargets([torch.zeros(2, 4, 4, 8, 2).transpose(3, 4)])
    targets = KVMoveTargets([a])
    assert targets.holds([a]) and not targets.holds([a.clone()])
    with pytest.raises(ValueError, match="same 1-D shape"):
        move_kv_slots(targets, torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="moves_per_seq=3"):
        move_kv_slots(targets, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 3)
