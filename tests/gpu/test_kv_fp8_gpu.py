"""FP8 KV cache kernels on CUDA (issue 25) against their torch twins over the same e4m3 caches, in
bf16 and fp16 at real head shapes: GQA (Llama-8B heads) KV write, paged attention (prefill, verify,
split decode), RoPE + KV write and the one-launch RoPE + attention; MLA (DeepSeek-V2-Lite widths)
latent writes and the absorbed attention. Writes must store the twin's bytes (both round to
nearest even with saturation); attention within the dtype's tolerance.

Every case draws fresh random inputs; a failure names the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding
from foretell.ops.attention.fp8_kv import FP8_E4M3, index_copy_slots, quantize_for_cache
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import TorchAttentionBackend, causal_attention, gather_context, write_kv_torch
from foretell.ops.attention.triton_paged import paged_attention_triton
from foretell.ops.attention.triton_rope_kv import rope_write_kv_triton
from foretell.ops.attention.triton_rope_paged import rope_paged_attention_triton
from foretell.ops.attention.triton_write_kv import write_kv_triton
from foretell.ops.mla.reference import TorchMLABackend, latent_write_torch
from foretell.ops.mla.triton_attention import mla_attention_triton
from foretell.ops.mla.triton_latent_write import latent_write_triton, write_latent_triton

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
K_SCALE, V_SCALE = 0.5, 2.0
BATCHES = {
    "prefill": [(0, 70), (40, 33), (0, 1)],
    "verify": [(300, 4), (1000, 4), (17, 4)],
    "decode": [(4000, 1), (129, 1), (1, 1), (700, 1)],
}


def _same_bytes(a, b, what):
    differ = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
    assert differ == 0, f"{what}: {differ} stored e4m3 bytes differ from the twin's"


def _paged(specs, block_size, seed):
    """Block table (blocks in random order), slot mappings of the prefixes and of the new tokens,
    and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32)
    table = torch.full((len(specs), max(blocks_per_seq) + 1), num_blocks - 1, dtype=torch.int32)
    used, prefix_slots, new_slots, qsl = 0, [], [], [0]
    for i, (n, (p, q)) in enumerate(zip(blocks_per_seq, specs)):
        table[i, :n] = order[used:used + n]
        used += n
        slots = [int(table[i, t // block_size]) * block_size + t % block_size for t in range(p + q)]
        prefix_slots += slots[:p]
        new_slots += slots[p:]
        qsl.append(qsl[-1] + q)
    seq_lens = [p + q for p, q in specs]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_table=table.to(DEVICE),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=DEVICE), block_size=block_size,
        max_query_len=max(q for _, q in specs), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens)
    return md, num_blocks, torch.tensor(prefix_slots, dtype=torch.int64, device=DEVICE)


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_gqa_fp8_kernels_match_torch(kind, dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    md, num_blocks, prefix = _paged(BATCHES[kind], block_size, seed)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=FP8_E4M3, device=DEVICE)
    n = prefix.numel()
    write_kv_torch(_randn(n, kv_heads, head_dim, dtype=dtype, gen=gen, scale=1.5),
                   _randn(n, kv_heads, head_dim, dtype=dtype, gen=gen), cache, prefix, K_SCALE, V_SCALE)
    t = md.num_tokens
    query = _randn(t, heads, head_dim, dtype=dtype, gen=gen, scale=1.5)
    key = _randn(t, kv_heads, head_dim, dtype=dtype, gen=gen, scale=300)  # some past 448 * k_scale
    value = _randn(t, kv_heads, head_dim, dtype=dtype, gen=gen)
    with reports_seed(seed):
        got_cache, want_cache = cache.clone(), cache.clone()
        write_kv_triton(key, value, got_cache, md.slot_mapping, K_SCALE, V_SCALE)
        write_kv_torch(key, value, want_cache, md.slot_mapping, K_SCALE, V_SCALE)
        _same_bytes(got_cache, want_cache, "write_kv_triton")
        key = key / 300
        got_cache, want_cache = cache.clone(), cache.clone()
        write_kv_triton(key, value, got_cache, md.slot_mapping, K_SCALE, V_SCALE)
        write_kv_torch(key, value, want_cache, md.slot_mapping, K_SCALE, V_SCALE)
        expected = TorchAttentionBackend().attend(query, want_cache, md, head_dim**-0.5, K_SCALE, V_SCALE)
        for splits in (None, 1, 8):
            out = torch.full_like(query, float("nan"))
            paged_attention_triton(query, got_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   md.max_query_len, head_dim**-0.5, out, num_splits=splits,
                                   k_scale=K_SCALE, v_scale=V_SCALE)
            assert not out.isnan().any()
            torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_rope_kv_write_and_one_launch_attention_over_fp8(kind, dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    md, num_blocks, prefix = _paged(BATCHES[kind], block_size, seed)
    base = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=FP8_E4M3, device=DEVICE)
    n = prefix.numel()
    write_kv_torch(_randn(n, kv_heads, head_dim, dtype=dtype, gen=gen, scale=1.5),
                   _randn(n, kv_heads, head_dim, dtype=dtype, gen=gen), base, prefix, K_SCALE, V_SCALE)
    t = md.num_tokens
    query = _randn(t, heads, head_dim, dtype=dtype, gen=gen, scale=1.5)
    key = _randn(t, kv_heads, head_dim, dtype=dtype, gen=gen, scale=1.5)
    value = _randn(t, kv_heads, head_dim, dtype=dtype, gen=gen)
    positions = torch.tensor([p + j for p, q in BATCHES[kind] for j in range(q)], device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 8192, 500000.0, None, "neox", device=DEVICE)
    norms = tuple(RMSNorm(head_dim, 1e-6, dtype=dtype, device=DEVICE) for _ in range(2))
    scale = head_dim**-0.5
    with reports_seed(seed):
        q, k = norms[0](query)[0], norms[1](key)[0]
        q, k = rotary(positions, q, k)
        want_cache = base.clone()
        write_kv_torch(k, value, want_cache, md.slot_mapping, K_SCALE, V_SCALE)
        expected = TorchAttentionBackend().attend(q, want_cache, md, scale, K_SCALE, V_SCALE)
        two_cache = base.clone()
        rope_write_kv_triton(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, two_cache,
                             md.slot_mapping, qk_norm=norms, k_scale=K_SCALE, v_scale=V_SCALE)
        one_cache = base.clone()
        out = rope_paged_attention_triton(positions, query, key, value, rotary.cos_cache, rotary.sin_cache,
                                          one_cache, md.slot_mapping, md.block_table, md.seq_lens,
                                          md.query_start_loc, md.max_query_len, scale, qk_norm=norms,
                                          k_scale=K_SCALE, v_scale=V_SCALE)
        # The rotation may fuse a product with its sum differently from torch (one rounding of the
        # dtype), which can move a stored e4m3 value by one step: few bytes may differ.
        for got in (two_cache, one_cache):
            differ = (got.view(torch.uint8) != want_cache.view(torch.uint8)).float().mean().item()
            assert differ < 0.01, f"{differ:.2%} of the stored bytes differ"
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_mla_fp8_kernels_match_torch(kind, dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, rank, rope, block_size = 16, 512, 64, 16
    md, num_blocks, prefix = _paged(BATCHES[kind], block_size, seed)
    base = torch.zeros(num_blocks, block_size, rank + rope, dtype=FP8_E4M3, device=DEVICE)
    index_copy_slots(base.flatten(0, 1), prefix,
                     quantize_for_cache(_randn(prefix.numel(), rank + rope, dtype=dtype, gen=gen), FP8_E4M3, K_SCALE))
    t = md.num_tokens
    latent, k_pe = _randn(t, rank, dtype=dtype, gen=gen), _randn(t, rope, dtype=dtype, gen=gen)
    q_lat = _randn(t, heads, rank, dtype=dtype, gen=gen, scale=0.3)
    q_pe = _randn(t, heads, rope, dtype=dtype, gen=gen)
    scale = 0.7 * (rank + rope) ** -0.5
    with reports_seed(seed):
        got_cache, want_cache = base.clone(), base.clone()
        write_latent_triton(latent, k_pe, got_cache, md.slot_mapping, K_SCALE)
        TorchMLABackend().write_kv(latent, k_pe, want_cache, md.slot_mapping, K_SCALE)
        _same_bytes(got_cache, want_cache, "write_latent_triton")
        out = torch.full_like(q_lat, float("nan"))
        mla_attention_triton(q_lat, q_pe, got_cache, md.block_table, md.seq_lens, md.query_start_loc,
                             md.max_query_len, scale, out, k_scale=K_SCALE)
        context = want_cache.float() * K_SCALE
        expected = torch.empty_like(out, dtype=torch.float32)
        for i, seq_len in enumerate(md.seq_lens_cpu):
            lo, hi = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            key = gather_context(context, md.block_table[i], seq_len).unsqueeze(1)
            query = torch.cat([q_lat[lo:hi], q_pe[lo:hi]], -1).float()
            expected[lo:hi] = causal_attention(query, key, key[..., :rank], scale)
        torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
        # the fused norm + RoPE + write
        norm = RMSNorm(rank, 1e-6, dtype=dtype, device=DEVICE)
        rotary = RotaryEmbedding(rope, 8192, 10000.0, None, "gptj", device=DEVICE)
        kv_a = _randn(t, rank + rope, dtype=dtype, gen=gen, scale=3)
        positions = torch.tensor([p + j for p, q in BATCHES[kind] for j in range(q)], device=DEVICE)
        got_cache, want_cache = base.clone(), base.clone()
        latent_write_triton(kv_a, positions, norm, rotary, got_cache, md.slot_mapping, K_SCALE)
        latent_write_torch(kv_a, positions, norm, rotary, want_cache, md.slot_mapping, K_SCALE)
        differ = (got_cache.view(torch.uint8) != want_cache.view(torch.uint8)).float().mean().item()
        assert differ < 0.01, f"{differ:.2%} of the latent bytes differ (norm order, RoPE FMA: one rounding)"
