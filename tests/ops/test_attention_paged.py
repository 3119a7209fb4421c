"""The Triton KV write and paged attention kernels held against their plain-torch twins.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (fp16 and fp32; the
interpreter's bf16 tl.dot is wrong, so bf16 is only checked on CUDA). TRITON_INTERPRET is set
here, by the test harness, only while this module imports and runs: the library never reads it.
Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.common.split_counters import SplitCounters
from foretell.ops.attention.reference import TorchAttentionBackend, write_kv_torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernels = import_interpreted("foretell.ops.attention.triton_paged")
write_kv = import_interpreted("foretell.ops.attention.triton_write_kv")
varlen = import_interpreted("foretell.ops.attention.triton_varlen")
from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402


DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}

# (cached prefix length, query length) per sequence.
BATCHES = {
    "prefill": [(0, 13), (0, 5), (0, 1), (0, 24)],
    "prefix_prefill": [(20, 7), (33, 16), (5, 9)],
    "decode": [(35, 1), (0, 1), (64, 1), (17, 1), (8, 1)],
    "verify": [(17, 3), (40, 5), (9, 2), (30, 6), (0, 4)],
    "mixed": [(0, 11), (35, 1), (17, 3), (21, 8), (3, 0), (64, 1), (40, 5), (0, 2)],
}
# Contexts over several 64-token tiles, ending just past a tile edge, so a split can hold only
# keys that some verify rows must not see yet.
LONG_BATCHES = {
    "decode": [(129, 1), (300, 1), (64, 1), (7, 1)],
    "verify": [(125, 5), (190, 3), (60, 6), (254, 2), (127, 1)],
}


def _new_seed() -> int:
    return random.randrange(2**31)


class Batch:
    """A random paged batch: the cache holds each sequence's prefix, this step writes the rest.

    Blocks are handed out in random order; every slot outside a context (unused tails, spare
    blocks, and the block that unused table entries point at) holds NaN, so a kernel that reads
    past a context shows it in its output.
    """

    def __init__(self, specs, num_kv_heads, group, head_dim, block_size, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.specs = specs
        num_heads = num_kv_heads * group
        blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
        num_blocks = sum(blocks_per_seq) + 3  # + spares, the last one is the "poison" block
        poison = num_blocks - 1
        order = torch.randperm(num_blocks - 1, generator=gen)
        width = max(blocks_per_seq + [1]) + 2
        table = torch.full((len(specs), width), poison, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = order[used : used + n].to(torch.int32)
            used += n

        def rand(*shape):
            return (torch.randn(*shape, generator=gen) * 1.5).to(dtype)

        cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
        cache = cache.to(dtype)
        prefix_slots, new_slots, query_start_loc = [], [], [0]
        for i, (prefix, q_len) in enumerate(specs):
            slots = [int(table[i, p // block_size]) * block_size + p % block_size
                     for p in range(prefix + q_len)]
            prefix_slots += slots[:prefix]
            new_slots += slots[prefix:]
            query_start_loc.append(query_start_loc[-1] + q_len)
        prefix_slots = torch.tensor(prefix_slots, dtype=torch.int64)
        n = len(prefix_slots)
        write_kv_torch(rand(n, num_kv_heads, head_dim), rand(n, num_kv_heads, head_dim),
                       cache, prefix_slots)
        num_tokens = query_start_loc[-1]
        self.key = rand(num_tokens, num_kv_heads, head_dim).to(DEVICE)
        self.value = rand(num_tokens, num_kv_heads, head_dim).to(DEVICE)
        self.query = rand(num_tokens, num_heads, head_dim).to(DEVICE)
        self.cache = cache.to(DEVICE)
        seq_lens = [p + q for p, q in specs]
        self.metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_table=table.to(DEVICE),
            slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=DEVICE),
            block_size=block_size,
            max_query_len=max(q for _, q in specs),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        self.scale = head_dim**-0.5


def _check_attention(batch: Batch, dtype, seed, num_splits=None, min_split_tokens=128):
    md = batch.metadata
    cache_ref = batch.cache.clone()
    write_kv_torch(batch.key, batch.value, cache_ref, md.slot_mapping)
    cache = batch.cache.clone()
    write_kv.write_kv_triton(batch.key, batch.value, cache, md.slot_mapping)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"write_kv mismatch (seed {seed}): {m}")

    expected = TorchAttentionBackend().attend(batch.query, cache_ref, md, batch.scale)
    out = torch.full_like(batch.query, float("nan"))
    returned = kernels.paged_attention_triton(
        batch.query, cache, md.block_table, md.seq_lens, md.query_start_loc,
        md.max_query_len, batch.scale, out, num_splits=num_splits, min_split_tokens=min_split_tokens,
    )
    assert returned is out
    assert not out.isnan().any(), f"rows left unwritten or NaN read (seed {seed})"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"attention mismatch (seed {seed}): {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group, block_size", [(1, 16), (2, 8), (4, 32), (4, 16)])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_attention_matches_torch(kind, group, block_size, dtype):
    seed = _new_seed()
    batch = Batch(BATCHES[kind], num_kv_heads=2, group=group, head_dim=64,
                  block_size=block_size, dtype=dtype, seed=seed)
    _check_attention(batch, dtype, seed)


@pytest.mark.parametrize("min_split_tokens", [1, 128])  # every split used / short contexts unsplit
@pytest.mark.parametrize("num_splits", [2, 3, 8, 32])
@pytest.mark.parametrize("kind", ["decode", "verify", "mixed"])
def test_split_context_matches_torch(kind, num_splits, min_split_tokens):
    seed = _new_seed()
    specs = LONG_BATCHES.get(kind, BATCHES[kind])
    batch = Batch(specs, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                  dtype=torch.float16, seed=seed)
    _check_attention(batch, torch.float16, seed, num_splits=num_splits, min_split_tokens=min_split_tokens)


def test_persistent_split_counters_reset_between_launches():
    """A backend's SplitCounters serve launch after launch: the merging program zeroes its own."""
    seed = _new_seed()
    batch = Batch(LONG_BATCHES["verify"], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                  dtype=torch.float16, seed=seed)
    md = batch.metadata
    cache = batch.cache.clone()
    write_kv.write_kv_triton(batch.key, batch.value, cache, md.slot_mapping)
    expected = TorchAttentionBackend().attend(batch.query, cache, md, batch.scale)
    counters = SplitCounters()
    for _ in range(3):
        out = torch.full_like(batch.query, float("nan"))
        kernels.paged_attention_triton(batch.query, cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       md.max_query_len, batch.scale, out, num_splits=4, min_split_tokens=1,
                                       counters=counters)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"seed {seed}: {m}")
        assert not counters.get(out.device, 1).any(), "a counter was left non-zero"


@pytest.mark.parametrize(
    "head_dim, group, num_splits",
    [(8, 2, 1), (16, 2, 1), (32, 2, 1), (128, 4, 1), (128, 4, 4), (256, 2, 1), (80, 3, 1),
     (64, 3, 2)],
)
def test_head_dims_and_odd_groups(head_dim, group, num_splits):
    seed = _new_seed()
    batch = Batch(BATCHES["mixed"], num_kv_heads=2, group=group, head_dim=head_dim,
                  block_size=16, dtype=torch.float16, seed=seed)
    _check_attention(batch, torch.float16, seed, num_splits=num_splits)


def test_long_prefill_spans_many_tiles():
    seed = _new_seed()
    batch = Batch([(70, 90), (0, 130), (150, 1), (97, 4)], num_kv_heads=1, group=4,
                  head_dim=32, block_size=16, dtype=torch.float16, seed=seed)
    _check_attention(batch, torch.float16, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_skips_negative_slots(dtype):
    seed = _new_seed()
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_kv_heads, head_dim = 9, 3, 64
    cache = torch.randn(2, 6, 8, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(48, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # CUDA-graph padding rows
    slots = slots.to(DEVICE)
    expected = cache.clone()
    real = slots >= 0
    write_kv_torch(key[real], value[real], expected, slots[real])
    write_kv.write_kv_triton(key, value, cache, slots)
    assert torch.equal(cache, expected), f"seed {seed}"


def test_write_kv_from_strided_views():
    # Keys and values usually arrive as views into one fused qkv projection.
    seed = _new_seed()
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32, generator=gen).half().to(DEVICE)
    key = qkv[:, 128:192].view(5, 2, 32)
    value = qkv[:, 192:].view(5, 2, 32)
    cache = torch.zeros(2, 3, 4, 2, 32, dtype=torch.float16, device=DEVICE)
    expected = cache.clone()
    slots = torch.tensor([0, 5, 6, 11, 3], device=DEVICE)
    write_kv_torch(key, value, expected, slots)
    write_kv.write_kv_triton(key, value, cache, slots)
    assert torch.equal(cache, expected), f"seed {seed}"


def test_backend_protocol_and_smaller_block_view():
    """Through the backend, and through metadata re-paged for a cache with smaller blocks."""
    seed = _new_seed()
    batch = Batch(BATCHES["mixed"], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                  dtype=torch.float16, seed=seed)
    backend, reference = TritonAttentionBackend(), TorchAttentionBackend()
    assert backend.name == "triton"
    for block_size in (16, 4):
        md = batch.metadata.with_block_size(block_size)
        ratio = 16 // block_size
        shape = (2, batch.cache.shape[1] * ratio, block_size) + tuple(batch.cache.shape[3:])
        cache = batch.cache.clone().view(shape)
        cache_ref = batch.cache.clone().view(shape)
        backend.write_kv(batch.key, batch.value, cache, md.slot_mapping)
        reference.write_kv(batch.key, batch.value, cache_ref, md.slot_mapping)
        out = backend.attend(batch.query, cache, md, batch.scale)
        expected = reference.attend(batch.query, cache_ref, md, batch.scale)
        torch.testing.assert_close(out, expected, rtol=5e-3, atol=5e-3,
                                   msg=lambda m: f"block size {block_size} (seed {seed}): {m}")
    with pytest.raises(ValueError, match="block_size"):
        backend.attend(batch.query, cache, batch.metadata, batch.scale)


def test_padding_rows_are_left_untouched():
    seed = _new_seed()
    batch = Batch(BATCHES["verify"], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                  dtype=torch.float16, seed=seed)
    md = batch.metadata
    cache = batch.cache.clone()
    write_kv_torch(batch.key, batch.value, cache, md.slot_mapping)
    padded = torch.cat([batch.query, batch.query[:3]])  # 3 padded rows past the last sequence
    for num_splits in (1, 2):
        out = torch.full_like(padded, float("nan"))
        kernels.paged_attention_triton(padded, cache, md.block_table, md.seq_lens,
                                       md.query_start_loc, md.max_query_len, batch.scale, out,
                                       num_splits=num_splits)
        num_tokens = batch.query.shape[0]
        assert not out[:num_tokens].isnan().any(), f"seed {seed}"
        assert out[num_tokens:].isnan().all(), f"seed {seed}"
