"""Draft-tree rows in the one-launch RoPE + KV write + paged attention kernel
(ops/attention/triton_rope_paged.py with tree_mask), in Triton's interpreter on CPU tensors.

A batch holds a tree verify (the ancestor mask of a tree built by spec_decode/tree/build.py), a
drafter's frontier rows (a mask reaching keys cached by earlier forwards), plain decode and verify
rows (all-true mask rows: causal) and a padded sequence (slot -1, all-true rows). The kernel is held
against the two launches it replaces with the same mask (rope_write_kv_triton, then
paged_attention_triton: the cache bit for bit; the output within the dtype's tolerance, its scores
summed in another order, so not bit for bit) and against reference.py's TorchAttentionBackend (within the dtype's tolerance),
over contexts that span tiles, split several ways. Then the layer: Attention.forward_rotary takes
the one launch for a tree's rows on the Triton backend and the modules on a backend without
fuses_tree_rope. Bad masks are refused.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import interpreter_mode  # noqa: F401
from foretell.layers.attention.layer import Attention
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.ops.common import kernel_choice
from foretell.spec_decode.tree.shape import TreeShape
from test_attention_paged import TOLERANCE
from test_attention_rope_paged import DEVICE, Step, _check, fused, rkv
from test_tree_attention import _random_frontier_mask, _random_tree_mask

from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402  (after the interpreted imports)


class TreeStep(Step):
    """A Step whose sequences may carry a mask: specs are (prefix_len, q_len, mask [q_len, w] over the
    sequence's last w <= width keys, or None: causal rows)."""

    def __init__(self, specs, width, group, head_dim, dtype, seed, **kwargs):
        super().__init__([(p, q) for p, q, _ in specs], group, head_dim, dtype, seed, **kwargs)
        starts = self.batch.metadata.query_start_loc_cpu
        mask = torch.ones(starts[-1], width, dtype=torch.bool)  # [num_tokens, width]
        for (_, q_len, rows), lo in zip(specs, starts):
            if rows is not None:  # its w columns are the last w of the width
                mask[lo:lo + q_len, width - rows.shape[1]:] = rows
        self.tree_mask = mask.to(DEVICE)
        # [num_tokens] bool: rows whose mask hides a key causal attention shows them
        self.tree_rows = torch.zeros(starts[-1], dtype=torch.bool, device=DEVICE)
        for (prefix, q_len, _), lo in zip(specs, starts):
            key_pos = prefix + q_len - width + torch.arange(width)  # [width]: each column's key
            for j in range(q_len):
                causal = (key_pos >= 0) & (key_pos <= prefix + j)
                self.tree_rows[lo + j] = bool((causal & ~mask[lo + j]).any())


def _batch_specs(gen: torch.Generator, tree_nodes: int, padded_rows: int):
    """A tree verify across a tile edge, a frontier, decode rows, a chain verify and a padded tree."""
    return [
        (125, tree_nodes, _random_tree_mask(TreeShape(4, 4, tree_nodes), gen)),  # keys 125.. cross the 128 tile edge
        (190, 2, _random_frontier_mask(2, 6, gen)),  # a drafter's depth 3 of topk 2
        (300, 1, None),  # decode rows: all-true mask rows
        (64, 3, None),  # a plain verify
        (40, padded_rows, None),  # padding (slot -1)
        (0, 4, _random_tree_mask(TreeShape(2, 2, 4), gen)),  # no cached prefix: a context shorter than the width
    ]


@pytest.mark.parametrize("num_splits, min_split_tokens", [(1, 128), (4, 1), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_tree_rows_match_the_two_launches_and_torch(dtype, num_splits, min_split_tokens):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    # float32 tiles hold 16 rows: 8 tokens of a group of 2; float16 ones 16 tokens of a group of 4
    group, nodes, width = (4, 16, 16) if dtype == torch.float16 else (2, 8, 8)
    step = TreeStep(_batch_specs(gen, nodes, nodes), width, group, 64, dtype, seed, padded=4)
    assert step.tree_rows.any()
    _check(step, dtype, seed, num_splits=num_splits, min_split_tokens=min_split_tokens)
    # the mask matters: causal attention gives other outputs on the rows it restricts
    with reports_seed(seed):
        got = step.run_fused(step.batch.cache.clone(), num_splits=num_splits, min_split_tokens=min_split_tokens)
        step.tree_mask, tree_mask = None, step.tree_mask
        causal = step.run_torch()
        step.tree_mask = tree_mask
        rows = step.tree_rows
        assert not torch.allclose(got[rows].float(), causal[rows].float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_qwen3_norms_gptj_and_a_bool_or_uint8_mask():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    specs = [(33, 6, _random_tree_mask(TreeShape(3, 2, 6), gen)), (17, 1, None),
             (70, 3, _random_frontier_mask(3, 8, gen))]
    step = TreeStep(specs, 8, 2, 32, torch.float32, seed, style="gptj", with_norm=True)
    _check(step, torch.float32, seed, num_splits=4, min_split_tokens=1)
    as_bool = step.run_fused(step.batch.cache.clone())
    step.tree_mask = step.tree_mask.to(torch.uint8)
    torch.testing.assert_close(step.run_fused(step.batch.cache.clone()), as_bool, rtol=0, atol=0)


def test_all_true_mask_equals_no_mask():
    """A chain's mask (lower triangle) and all-true rows leave the rows causal: the same bits as
    the kernel without a mask."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    specs = [(20, 5, _random_tree_mask(TreeShape.chain(4), gen)), (9, 1, None), (130, 3, None)]
    step = TreeStep(specs, 8, 4, 64, torch.float16, seed)
    assert not step.tree_rows.any()
    masked = step.run_fused(step.batch.cache.clone(), num_splits=4, min_split_tokens=1)
    step.tree_mask = None
    torch.testing.assert_close(masked, step.run_fused(step.batch.cache.clone(), num_splits=4, min_split_tokens=1),
                               rtol=0, atol=0)


def test_bad_tree_mask_is_refused():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    step = TreeStep([(13, 6, _random_tree_mask(TreeShape(3, 2, 6), gen)), (4, 1, None)], 8, 2, 32, torch.float32, seed)
    mask = step.tree_mask
    for bad in (mask[:-1], mask.float(), mask[:, 0], mask.to(torch.int32)):
        step.tree_mask = bad
        with pytest.raises(ValueError, match="tree_mask must be"):
            step.run_fused(step.batch.cache.clone())


def _tree_layer_step(seed: int) -> TreeStep:
    gen = torch.Generator().manual_seed(seed)
    specs = [(21, 8, _random_tree_mask(TreeShape(3, 3, 8), gen)), (50, 1, None),
             (6, 2, _random_frontier_mask(2, 5, gen))]
    step = TreeStep(specs, 8, 4, 64, torch.float16, seed)
    step.batch.metadata.tree_mask = step.tree_mask
    return step


class _RopeWithoutTrees(TritonAttentionBackend):
    """A backend whose rope_attend would ignore a tree mask (as the batch-invariant one does)."""

    fuses_tree_rope = False


@pytest.mark.parametrize("backend", [TritonAttentionBackend, _RopeWithoutTrees])
def test_forward_rotary_fuses_tree_rows_only_on_a_backend_that_takes_the_mask(monkeypatch, backend):
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    calls = []
    for module, name in ((fused, "rope_paged_attention_triton"), (rkv, "rope_write_kv_triton")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name, **kw: calls.append(
            (name, kw.get("tree_mask") is not None)) or kernel(*a, **kw))
    seed = random.randrange(2**31)
    step = _tree_layer_step(seed)
    layer = Attention(8, 64, 2, step.batch.scale, backend())
    layer.bind_kv_cache(step.batch.cache.clone())
    with reports_seed(seed):
        got = layer.forward_rotary(step.positions, step.query, step.key, step.value, step.rotary, step.batch.metadata)
        assert calls == ([("rope_paged_attention_triton", True)] if backend is TritonAttentionBackend else [])
        expected = step.run_torch()
        torch.testing.assert_close(got.float(), expected.float(), rtol=TOLERANCE[torch.float16],
                                   atol=TOLERANCE[torch.float16])


def test_batch_invariant_backend_is_not_fused_with_a_mask():
    from foretell.ops.attention.triton_batch_invariant import BatchInvariantTritonAttention

    assert BatchInvariantTritonAttention.fuses_rope and not getattr(BatchInvariantTritonAttention,
                                                                    "fuses_tree_rope", False)
    assert TritonAttentionBackend.fuses_tree_rope and not getattr(TorchAttentionBackend, "fuses_tree_rope", False)
