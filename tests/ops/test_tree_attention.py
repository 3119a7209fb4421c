"""Tree attention over the paged cache: the torch reference's and the Triton kernel's tree_mask
against a dense float64 computation, and a chain-shaped mask against plain causal attention.

Each sequence of a batch has a cached prefix and q_len new rows; the mask's W columns address the
sequence's last W keys. A tree verify's rows carry its ancestor mask over its own rows; a drafter's
frontier rows (q_len = topk new rows) carry a mask over more keys than their own rows (the earlier
frontier rows, already cached); other rows (decode, a prefill chunk longer than the mask width, a
context shorter than it) carry all-true mask rows, which must leave them causal. The Triton kernel
runs in the interpreter on a CPU (fp16, fp32).
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import TorchAttentionBackend, write_kv_torch
from foretell.spec_decode.tree.build import build_tree
from foretell.spec_decode.tree.shape import TreeShape

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernels = import_interpreted("foretell.ops.attention.triton_paged")

TOLERANCE = {torch.float16: 5e-3, torch.float32: 1e-4}
MASK_WIDTH = 8


def _random_tree_mask(shape: TreeShape, gen: torch.Generator) -> torch.Tensor:  # [T, T] bool
    vocab = 11
    tree = build_tree(shape, torch.zeros(1, dtype=torch.int64), torch.randn(1, vocab, generator=gen),
                      lambda tokens, slot, depth: torch.randn(1, shape.topk, vocab, generator=gen))
    return tree.ancestor_mask[0]


def _random_frontier_mask(q_len: int, width: int, gen: torch.Generator) -> torch.Tensor:  # [q_len, width] bool
    """Any rows over the last `width` keys (the q_len new rows are the last q_len of them), each row
    seeing at least itself: the dense truth takes whatever the mask marks."""
    mask = torch.rand(q_len, width, generator=gen) < 0.5
    mask[torch.arange(q_len), width - q_len + torch.arange(q_len)] = True
    return mask


class TreeBatch:
    """specs: per sequence (prefix_len, q_len, mask [q_len, w] over its last w keys (w <= MASK_WIDTH)
    or None: causal rows)."""

    def __init__(self, specs, num_kv_heads, group, head_dim, block_size, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.specs = specs
        num_heads = num_kv_heads * group
        lens = [p + q for p, q, _ in specs]
        blocks_per_seq = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks_per_seq) + 2
        order = torch.randperm(num_blocks - 1, generator=gen)
        table = torch.full((len(specs), max(blocks_per_seq) + 1), num_blocks - 1, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = order[used:used + n].to(torch.int32)
            used += n
        # the dense truth: every position's key and value, float64 from the stored dtype
        self.keys = [(torch.randn(n, num_kv_heads, head_dim, generator=gen)).to(dtype) for n in lens]
        self.values = [(torch.randn(n, num_kv_heads, head_dim, generator=gen)).to(dtype) for n in lens]
        self.queries = [(torch.randn(q, num_heads, head_dim, generator=gen)).to(dtype) for _, q, _ in specs]
        cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(dtype)
        all_slots = []
        for i, n in enumerate(lens):
            slots = torch.tensor([int(table[i, p // block_size]) * block_size + p % block_size for p in range(n)])
            all_slots.append(slots)
            write_kv_torch(self.keys[i], self.values[i], cache, slots)  # prefix and this step's rows
        self.cache = cache.to(DEVICE)
        starts = [0]
        for _, q, _ in specs:
            starts.append(starts[-1] + q)
        self.query = torch.cat(self.queries).to(DEVICE)
        mask = torch.ones(starts[-1], MASK_WIDTH, dtype=torch.bool)
        for (_, q, tree_mask), lo in zip(specs, starts):
            if tree_mask is not None:  # columns: the last MASK_WIDTH keys; this mask's w are the last w of those
                mask[lo:lo + q, MASK_WIDTH - tree_mask.shape[1]:] = tree_mask
        self.tree_mask = mask.to(DEVICE)
        self.metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            block_table=table.to(DEVICE),
            slot_mapping=torch.cat([s[p:] for s, (p, _, _) in zip(all_slots, specs)]).to(DEVICE),
            block_size=block_size,
            max_query_len=max(q for _, q, _ in specs),
            max_seq_len=max(lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lens,
        )
        self.scale = head_dim ** -0.5
        self.group = group

    def dense_float64(self) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        outs = []
        for (prefix, q_len, tree_mask), query, key, value in zip(self.specs, self.queries, self.keys, self.values):
            seq_len = prefix + q_len
            row_position = torch.arange(prefix, seq_len).unsqueeze(1)  # [q_len, 1]
            visible = torch.arange(seq_len).unsqueeze(0) <= row_position  # [q_len, seq_len] causal
            if tree_mask is not None:
                visible[:, seq_len - tree_mask.shape[1]:] &= tree_mask
            k = key.double().repeat_interleave(self.group, dim=1)  # [n, num_heads, head_dim]
            v = value.double().repeat_interleave(self.group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query.double(), k) * self.scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        return torch.cat(outs)


def _specs(gen: torch.Generator, with_other_rows: bool):
    specs = [
        (13, 6, _random_tree_mask(TreeShape(3, 2, 6), gen)),
        (0, 8, _random_tree_mask(TreeShape(4, 3, 8), gen)),  # no cached prefix
        (37, 5, _random_tree_mask(TreeShape(2, 4, 5), gen)),  # a wide, shallow tree
        (20, 4, _random_tree_mask(TreeShape.chain(3), gen)),
    ]
    if with_other_rows:  # a decode row; a chunk longer than the mask width; contexts shorter than it
        specs += [(29, 1, None), (5, 19, None), (0, 1, None), (2, 3, None)]
    return specs


def _frontier_specs(gen: torch.Generator):
    """A drafter's depth forwards: topk new rows whose mask reaches the (d - 1) * topk frontier rows
    cached just before them (and a tree verify that is shorter than the mask width)."""
    return [
        (17, 2, _random_frontier_mask(2, 6, gen)),  # depth 3 of topk 2 over a 13-token context
        (4, 4, _random_frontier_mask(4, 8, gen)),  # depth 2 of topk 4 with no verified context: every key masked
        (3, 2, _random_frontier_mask(2, 4, gen)),  # the mask's columns start past the context's first keys
        (9, 3, _random_frontier_mask(3, 3, gen)),  # depth 1: only its own rows
        (25, 5, _random_tree_mask(TreeShape(2, 4, 5), gen)),  # a verify tree narrower than the mask
        (11, 1, None),
    ]


@pytest.mark.parametrize("with_other_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_tree_mask_matches_dense_float64(dtype, with_other_rows):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    batch = TreeBatch(_specs(gen, with_other_rows), num_kv_heads=2, group=2, head_dim=32, block_size=8,
                      dtype=dtype, seed=seed)
    truth = batch.dense_float64()
    md = batch.metadata
    reference = TorchAttentionBackend().attend(batch.query, batch.cache, md, batch.scale, tree_mask=batch.tree_mask)
    out = torch.full_like(batch.query, float("nan"))
    kernels.paged_attention_triton(batch.query, batch.cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   md.max_query_len, batch.scale, out, tree_mask=batch.tree_mask)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(reference.double().cpu(), truth, rtol=tol, atol=tol,
                               msg=lambda m: f"torch reference vs float64 (seed {seed}): {m}")
    torch.testing.assert_close(out.double().cpu(), truth, rtol=tol, atol=tol,
                               msg=lambda m: f"Triton vs float64 (seed {seed}): {m}")
    # the mask matters: without it the tree rows differ (no row would otherwise be checked)
    causal = TorchAttentionBackend().attend(batch.query, batch.cache, md, batch.scale)
    assert not torch.allclose(causal.double().cpu(), truth, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_frontier_rows_mask_cached_keys(dtype):
    """The mask's columns are the last W keys, so rows fewer than W reach keys cached by an earlier
    forward (a drafter's earlier frontier rows) through their mask; keys before those stay visible."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    batch = TreeBatch(_frontier_specs(gen), num_kv_heads=2, group=2, head_dim=32, block_size=4,
                      dtype=dtype, seed=seed)
    truth = batch.dense_float64()
    md = batch.metadata
    backend = TorchAttentionBackend()
    reference = backend.attend(batch.query, batch.cache, md, batch.scale, tree_mask=batch.tree_mask)
    out = torch.full_like(batch.query, float("nan"))
    kernels.paged_attention_triton(batch.query, batch.cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   md.max_query_len, batch.scale, out, tree_mask=batch.tree_mask)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(reference.double().cpu(), truth, rtol=tol, atol=tol,
                               msg=lambda m: f"torch reference vs float64 (seed {seed}): {m}")
    torch.testing.assert_close(out.double().cpu(), truth, rtol=tol, atol=tol,
                               msg=lambda m: f"Triton vs float64 (seed {seed}): {m}")
    # one sequence alone takes the reference's no-output-buffer path: same semantics
    one = TreeBatch(batch.specs[:1], num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=dtype, seed=seed)
    torch.testing.assert_close(backend.attend(one.query, one.cache, one.metadata, one.scale, tree_mask=one.tree_mask),
                               one.dense_float64().to(dtype).to(one.query.device), rtol=tol, atol=tol)
    # the columns before a sequence's own rows matter: masking only its own rows (as the old
    # first-W-new-rows reading did) gives other outputs
    own_rows_only = batch.tree_mask.clone()
    for (_, q_len, _), lo in zip(batch.specs, md.query_start_loc_cpu):
        own_rows_only[lo:lo + q_len, :MASK_WIDTH - q_len] = True
    loose = backend.attend(batch.query, batch.cache, md, batch.scale, tree_mask=own_rows_only)
    assert not torch.allclose(loose.double().cpu(), truth, rtol=tol, atol=tol)


def test_split_context_with_tree_mask():
    """Flash-decoding splits see the same mask (long contexts, forced splits)."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    specs = [(130, 6, _random_tree_mask(TreeShape(3, 2, 6), gen)), (61, 8, _random_tree_mask(TreeShape(4, 2, 8), gen)),
             (90, 2, _random_frontier_mask(2, 8, gen))]  # frontier rows reaching cached keys across splits
    batch = TreeBatch(specs, num_kv_heads=1, group=4, head_dim=32, block_size=16, dtype=torch.float16, seed=seed)
    md = batch.metadata
    out = torch.full_like(batch.query, float("nan"))
    kernels.paged_attention_triton(batch.query, batch.cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   md.max_query_len, batch.scale, out, num_splits=4, min_split_tokens=1,
                                   tree_mask=batch.tree_mask)
    torch.testing.assert_close(out.double().cpu(), batch.dense_float64(), rtol=5e-3, atol=5e-3,
                               msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_chain_mask_equals_causal(dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    chain = [(11, 5, _random_tree_mask(TreeShape.chain(4), gen)), (0, 3, _random_tree_mask(TreeShape.chain(2), gen))]
    assert torch.equal(chain[0][2], torch.ones(5, 5, dtype=torch.bool).tril_())
    batch = TreeBatch(chain, num_kv_heads=2, group=2, head_dim=32, block_size=8, dtype=dtype, seed=seed)
    md = batch.metadata
    backend = TorchAttentionBackend()
    torch.testing.assert_close(backend.attend(batch.query, batch.cache, md, batch.scale, tree_mask=batch.tree_mask),
                               backend.attend(batch.query, batch.cache, md, batch.scale), rtol=0, atol=0)
    masked = torch.empty_like(batch.query)
    causal = torch.empty_like(batch.query)
    for out, mask in ((masked, batch.tree_mask), (causal, None)):
        kernels.paged_attention_triton(batch.query, batch.cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       md.max_query_len, batch.scale, out, tree_mask=mask)
    torch.testing.assert_close(masked, causal, rtol=0, atol=0)


def test_bad_tree_mask_is_refused():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    batch = TreeBatch(_specs(gen, False), num_kv_heads=2, group=2, head_dim=32, block_size=8,
                      dtype=torch.float32, seed=seed)
    md = batch.metadata
    out = torch.empty_like(batch.query)
    for bad in (batch.tree_mask[:-1], batch.tree_mask.float(), batch.tree_mask[:, 0]):
        with pytest.raises(ValueError, match="tree_mask"):
            kernels.paged_attention_triton(batch.query, batch.cache, md.block_table, md.seq_lens,
                                           md.query_start_loc, md.max_query_len, batch.scale, out, tree_mask=bad)
