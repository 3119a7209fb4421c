"""The Triton attention kernels on a CUDA device: bf16/fp16 at real sizes, the split-K choice,
no host sync in a launch, and capture/replay inside a CUDA graph. Held against the torch twin.

Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch


from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import (
    TorchAttentionBackend,
    write_kv_torch,
)
from foretell.ops.attention.triton_backend import TritonAttentionBackend
from foretell.ops.attention.triton_paged import paged_attention_triton
from foretell.ops.attention.triton_write_kv import write_kv_triton

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 2e-4}


def _batch(specs, num_kv_heads, group, head_dim, block_size, dtype, seed, extra_width=0):
    """Random paged batch; specs are (cached prefix, query length). Returns everything needed
    to write this step's keys/values and attend. Unused slots hold NaN."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE).to(torch.int32)
    width = max(blocks_per_seq) + extra_width
    table = torch.full((len(specs), width), num_blocks - 1, dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = order[used : used + n]
        used += n
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=dtype, device=DEVICE)
    # Fill every context slot (prefix and new) at random; this step then rewrites the new ones.
    positions = [torch.arange(p + q, device=DEVICE) for p, q in specs]
    slot_rows = [table[i, pos // block_size].long() * block_size + pos % block_size
                 for i, pos in enumerate(positions)]
    all_slots = torch.cat(slot_rows)
    n = all_slots.numel()

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * 1.5).to(dtype)

    write_kv_torch(rand(n, num_kv_heads, head_dim), rand(n, num_kv_heads, head_dim), cache,
                   all_slots)
    new_slots = torch.cat([rows[p:] for rows, (p, _) in zip(slot_rows, specs)])
    query_start_loc = [0]
    for _, q in specs:
        query_start_loc.append(query_start_loc[-1] + q)
    seq_lens = [p + q for p, q in specs]
    num_tokens = query_start_loc[-1]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table,
        slot_mapping=new_slots,
        block_size=block_size,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    query = rand(num_tokens, num_kv_heads * group, head_dim)
    key = rand(num_tokens, num_kv_heads, head_dim)
    value = rand(num_tokens, num_kv_heads, head_dim)
    return query, key, value, cache, metadata


def _compare(specs, num_kv_heads, group, head_dim, block_size, dtype, num_splits=None,
             extra_width=0):
    seed = random.randrange(2**31)
    query, key, value, cache, md = _batch(specs, num_kv_heads, group, head_dim, block_size,
                                          dtype, seed, extra_width)
    cache_ref = cache.clone()
    write_kv_torch(key, value, cache_ref, md.slot_mapping)
    write_kv_triton(key, value, cache, md.slot_mapping)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"write_kv (seed {seed}): {m}")
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().attend(query, cache_ref, md, scale)
    out = torch.full_like(query, float("nan"))
    paged_attention_triton(query, cache, md.block_table, md.seq_lens, md.query_start_loc,
                           md.max_query_len, scale, out, num_splits=num_splits)
    assert not out.isnan().any(), f"unwritten rows or NaN read (seed {seed})"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"attention (seed {seed}): {m}")


MIXED = [(0, 300), (1000, 1), (517, 4), (2047, 1), (64, 200), (333, 6), (0, 1), (4000, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_llama_shapes_mixed_batch(dtype, group):
    _compare(MIXED, num_kv_heads=8, group=group, head_dim=128, block_size=16, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_other_head_dims_and_block_sizes(head_dim, block_size):
    _compare(MIXED, num_kv_heads=4, group=2, head_dim=head_dim, block_size=block_size,
             dtype=torch.bfloat16)


@pytest.mark.parametrize("num_splits", [None, 1, 5, 32])
@pytest.mark.parametrize("q_len", [1, 4])
def test_long_context_decode_and_verify(num_splits, q_len):
    specs = [(8191 - q_len, q_len), (4095, q_len), (100, q_len)]
    _compare(specs, num_kv_heads=8, group=4, head_dim=128, block_size=16,
             dtype=torch.bfloat16, num_splits=num_splits, extra_width=64)


def test_split_merge_by_last_program_is_race_free():
    """64 splits of 16 tokens: many programs of a group finish together; the one that arrives last
    merges. Repeated launches (the counters reset themselves) give identical, correct outputs."""
    specs = [(2000, 1), (1023, 4), (37, 1), (500, 3)]
    seed = random.randrange(2**31)
    query, key, value, cache, md = _batch(specs, 8, 4, 128, 16, torch.bfloat16, seed, 64)
    write_kv_triton(key, value, cache, md.slot_mapping)
    expected = TorchAttentionBackend().attend(query, cache, md, 128**-0.5)
    outs = []
    for _ in range(20):
        out = torch.full_like(query, float("nan"))
        paged_attention_triton(query, cache, md.block_table, md.seq_lens, md.query_start_loc,
                               md.max_query_len, 128**-0.5, out, num_splits=64, min_split_tokens=16)
        outs.append(out)
    torch.testing.assert_close(outs[0].float(), expected.float(), rtol=2e-2, atol=2e-2,
                               msg=lambda m: f"split merge (seed {seed}): {m}")
    assert all(torch.equal(o, outs[0]) for o in outs), f"launches differ (seed {seed})"


def test_large_prefill_with_prefix():
    _compare([(3000, 2048), (0, 1500)], num_kv_heads=8, group=4, head_dim=128, block_size=16,
             dtype=torch.bfloat16)


def test_launch_does_not_sync():
    query, key, value, cache, md = _batch([(2000, 1)] * 4 + [(300, 4)], 8, 4, 128, 16,
                                          torch.bfloat16, seed=1)
    backend = TritonAttentionBackend()
    backend.write_kv(key, value, cache, md.slot_mapping)  # compile outside the check
    backend.attend(query, cache, md, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.write_kv(key, value, cache, md.slot_mapping)
        backend.attend(query, cache, md, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_graph_capture_and_replay():
    """Capture one decode/verify step shape, then replay it with new lengths and contents."""
    num_kv_heads, group, head_dim, block_size = 8, 4, 128, 16
    specs = [(700, 1), (1500, 4), (30, 4), (3000, 1)]
    seed = random.randrange(2**31)
    query, key, value, cache, md = _batch(specs, num_kv_heads, group, head_dim, block_size,
                                          torch.bfloat16, seed, extra_width=200)
    backend = TritonAttentionBackend()
    static = {name: t.clone() for name, t in [("query", query), ("key", key), ("value", value)]}
    static_md = AttentionMetadata(
        query_start_loc=md.query_start_loc.clone(), seq_lens=md.seq_lens.clone(),
        block_table=md.block_table.clone(), slot_mapping=md.slot_mapping.clone(),
        block_size=block_size, max_query_len=4, max_seq_len=md.max_seq_len,
        query_start_loc_cpu=md.query_start_loc_cpu, seq_lens_cpu=md.seq_lens_cpu,
    )
    static_cache = torch.full((2, 600) + tuple(cache.shape[2:]), float("nan"),
                              dtype=cache.dtype, device=DEVICE)
    static_cache[:, : cache.shape[1]].copy_(cache)

    def step():
        backend.write_kv(static["key"], static["value"], static_cache, static_md.slot_mapping)
        return backend.attend(static["query"], static_cache, static_md, head_dim**-0.5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles every kernel before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    # Replay with other sequences of the same batch shape: longer contexts, other blocks.
    for replay in range(2):
        new_specs = [(900 + 150 * replay, 1), (2200, 4), (31, 4), (3100 - replay, 1)]
        q2, k2, v2, c2, md2 = _batch(new_specs, num_kv_heads, group, head_dim, block_size,
                                     torch.bfloat16, seed + 1 + replay)
        width = md2.block_table.shape[1]
        assert width <= static_md.block_table.shape[1] and c2.shape[1] <= static_cache.shape[1]
        static["query"].copy_(q2)
        static["key"].copy_(k2)
        static["value"].copy_(v2)
        static_cache.fill_(float("nan"))
        static_cache[:, : c2.shape[1]].copy_(c2)
        static_md.query_start_loc.copy_(md2.query_start_loc)
        static_md.seq_lens.copy_(md2.seq_lens)
        static_md.block_table.zero_()
        static_md.block_table[:, :width].copy_(md2.block_table)
        static_md.slot_mapping.copy_(md2.slot_mapping)
        graph.replay()
        cache_ref = c2.clone()
        write_kv_torch(k2, v2, cache_ref, md2.slot_mapping)
        expected = TorchAttentionBackend().attend(q2, cache_ref, md2, head_dim**-0.5)
        torch.testing.assert_close(static_out.float(), expected.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"replay {replay} (seed {seed}): {m}")


@pytest.mark.parametrize("num_splits", [None, 1, 8, 64])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_attention_in_one_launch_at_llama_shapes(num_splits, q_len, with_norm):
    """RoPE + KV write + attention in one launch (ops/attention/triton_rope_paged.py), bf16, 8 kv heads x 4,
    head_dim 128, long contexts split many ways (each split writes the new tokens of its tiles),
    repeated 5 times to shake out races: the cache and the output within bf16 rounding of the
    two-launch path's, and every repeat identical. (Not bit for bit on a GPU: the compiler fuses
    RoPE's products with their sums differently in the two kernels, as in _check_rope of
    test_pointwise_kernels_gpu.py; Triton's interpreter keeps every rounding and the CPU test
    checks the cache bit for bit.)"""
    from foretell.layers.norm import RMSNorm
    from foretell.layers.rotary import RotaryEmbedding

    specs = [(8191 - q_len, q_len), (4095, q_len), (100, q_len), (63, q_len)]
    seed = random.randrange(2**31)
    query, key, value, cache, md = _batch(specs, 8, 4, 128, 16, torch.bfloat16, seed, extra_width=64)
    positions = torch.cat([torch.arange(p, p + q, device=DEVICE) for p, q in specs])
    rotary = RotaryEmbedding(128, 16384, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, device=DEVICE)
    qk_norm = None
    if with_norm:
        qk_norm = (RMSNorm(128, 1e-6, dtype=torch.bfloat16, device=DEVICE),
                   RMSNorm(128, 1e-6, dtype=torch.bfloat16, device=DEVICE))
        for norm in qk_norm:
            norm.weight.data.normal_(1.0, 0.3)
    _one_launch_against_two(positions, query, key, value, rotary, cache, md, num_splits, seed, qk_norm=qk_norm)


def _one_launch_against_two(positions, query, key, value, rotary, cache, md, num_splits, seed, qk_norm=None,
                            tree_mask=None) -> torch.Tensor:  # the one launch's output [num_tokens, heads, 128]
    """rope_paged_attention_triton five times against rope_write_kv_triton + paged_attention_triton
    (the same mask): caches and outputs within bf16 rounding, every repeat identical."""
    from foretell.ops.attention.triton_rope_paged import rope_paged_attention_triton
    from foretell.ops.attention.triton_rope_kv import rope_write_kv_triton

    rope = (rotary.cos_cache, rotary.sin_cache)
    two_cache = cache.clone()
    q = rope_write_kv_triton(positions, query, key, value, *rope, two_cache, md.slot_mapping, qk_norm=qk_norm)
    expected = torch.full_like(q, float("nan"))
    paged_attention_triton(q, two_cache, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len,
                           128**-0.5, expected, num_splits=num_splits, tree_mask=tree_mask)
    outs = []
    for _ in range(5):
        one_cache = cache.clone()
        outs.append(rope_paged_attention_triton(
            positions, query, key, value, *rope, one_cache, md.slot_mapping, md.block_table, md.seq_lens,
            md.query_start_loc, md.max_query_len, 128**-0.5, qk_norm=qk_norm, num_splits=num_splits,
            tree_mask=tree_mask))
        torch.testing.assert_close(one_cache, two_cache, rtol=2e-2, atol=2e-2, equal_nan=True,
                                   msg=lambda m: f"cache (seed {seed}): {m}")
        assert (one_cache != two_cache).logical_and(~two_cache.isnan()).float().mean() < 1e-3
    torch.testing.assert_close(outs[0].float(), expected.float(), rtol=2e-2, atol=2e-2,
                               msg=lambda m: f"attention (seed {seed}): {m}")
    assert all(torch.equal(o, outs[0]) for o in outs), f"launches differ (seed {seed})"
    return outs[0]


def _ancestor_mask(shape, seed: int) -> torch.Tensor:  # [T, T] bool: a random draft tree's ancestor mask
    from foretell.spec_decode.tree.build import build_tree

    gen = torch.Generator().manual_seed(seed)
    vocab = 23
    tree = build_tree(shape, torch.zeros(1, dtype=torch.int64), torch.randn(1, vocab, generator=gen),
                      lambda tokens, slot, depth: torch.randn(1, shape.topk, vocab, generator=gen))
    return tree.ancestor_mask[0]


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_rope_attention_in_one_launch_with_a_tree_mask(num_splits):
    """A 16-node tree verify (ops/attention/triton_rope_paged.py with tree_mask) beside decode rows,
    a chain verify and a drafter's frontier rows, bf16 at Llama-8B heads, long contexts: the cache
    and the output within bf16 rounding of the two launches with the same mask (rope_write_kv_triton,
    paged_attention_triton), every repeat identical, and the mask matters."""
    from foretell.ops.attention.triton_rope_paged import rope_paged_attention_triton
    from foretell.layers.rotary import RotaryEmbedding
    from foretell.spec_decode.tree.shape import TreeShape

    width = 16
    specs = [(511, 16), (4095, 1), (700, 4), (8000, 3), (63, 16)]
    seed = random.randrange(2**31)
    query, key, value, cache, md = _batch(specs, 8, 4, 128, 16, torch.bfloat16, seed, extra_width=64)
    mask = torch.ones(md.query_start_loc_cpu[-1], width, dtype=torch.bool)  # [num_tokens, width]; decode rows all true
    starts = md.query_start_loc_cpu
    mask[starts[0]:starts[1]] = _ancestor_mask(TreeShape(5, 4, 16), seed)
    frontier = torch.rand(3, width, generator=torch.Generator().manual_seed(seed)) < 0.5
    frontier[torch.arange(3), width - 3 + torch.arange(3)] = True  # each frontier row sees itself
    mask[starts[3]:starts[4]] = frontier
    mask[starts[4]:starts[5]] = _ancestor_mask(TreeShape(3, 4, 16), seed + 1)
    mask[starts[2]:starts[3], width - 4:] = torch.ones(4, 4, dtype=torch.bool).tril_()  # a chain: causal
    mask = mask.to(DEVICE)
    positions = torch.cat([torch.arange(p, p + q, device=DEVICE) for p, q in specs])
    rotary = RotaryEmbedding(128, 16384, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, device=DEVICE)
    out = _one_launch_against_two(positions, query, key, value, rotary, cache, md, num_splits, seed, tree_mask=mask)
    assert not out.isnan().any(), f"unwritten rows or NaN read (seed {seed})"
    causal = rope_paged_attention_triton(positions, query, key, value, rotary.cos_cache, rotary.sin_cache,
                                         cache.clone(), md.slot_mapping,
                                         md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len,
                                         128**-0.5, num_splits=num_splits)
    tree_rows = slice(starts[0], starts[1])
    assert not torch.allclose(causal[tree_rows].float(), out[tree_rows].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(causal[starts[1]:starts[3]].float(), out[starts[1]:starts[3]].float(),
                               rtol=2e-2, atol=2e-2,
                               msg=lambda m: f"decode and chain rows under all-true / causal masks (seed {seed}): {m}")
