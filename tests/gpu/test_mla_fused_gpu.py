"""The fused MLA kernels (ops/mla/triton_fused.py, triton_latent_write.py) on a CUDA device at
DeepSeek-V2-Lite sizes (16 heads, nope 128, rope 64, kv_lora_rank 512, v 128; the matmuls also at
V3's 128 heads), bf16 and fp16, against their torch twins on the same device; the Triton backend's
attend_projections against the torch backend's; an MLAAttention forward with no host sync, captured
in a CUDA graph and replayed with new tokens, positions, slots and contexts.

The latent write and the RoPE round where their twins round, but a float32 reduction in another
order (the norm) or a product contracted into an FMA (RoPE, see test_pointwise_kernels_gpu.py) can
send a small fraction of roundings the other way: those are allowed to differ by a unit or two in
the last place. The matmuls are held to a relative error.
Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch


from fixtures.seeds import reports_seed
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.mla import MLAAttention, MLADims
from foretell.ops.mla.reference import (
    absorb_query_torch,
    latent_write_torch,
    project_values_torch,
    split_kv_b,
)
from foretell.ops.mla.triton_backend import TritonMLABackend
from foretell.ops.mla.triton_fused import absorb_query_triton, project_values_triton
from foretell.ops.mla.triton_latent_write import latent_write_triton
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]
HEADS, NOPE, ROPE, RANK, V = 16, 128, 64, 512, 128
HIDDEN = 2048
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
NEAR = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3), torch.float16: dict(rtol=4e-3, atol=1e-4)}
MAX_DIFFERING_FRACTION = 0.01
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # largest relative rounding error
MATMUL_REL_ERROR = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _seed() -> int:
    return random.randrange(2**31)


def _rotary(style="gptj", scaling=YARN) -> RotaryEmbedding:
    return RotaryEmbedding(ROPE, 163840, 10000.0, scaling, style, device=DEVICE)


def _near(got, want, dtype):
    torch.testing.assert_close(got, want, equal_nan=True, **NEAR[dtype])
    real = ~want.isnan()
    differing = (got[real] != want[real]).float().mean().item()
    assert differing <= MAX_DIFFERING_FRACTION, f"{differing:.2%} of the values differ"


def _near_cache(got, want, dtype):
    """Latent caches: the normed c near-equal; k_pe within a rounding of its magnitude (see
    _check_rope; the values are O(1) here)."""
    assert torch.equal(got.isnan(), want.isnan()), "written slots differ"
    _near(got[..., :RANK], want[..., :RANK], dtype)
    torch.testing.assert_close(got[..., RANK:], want[..., RANK:], equal_nan=True, rtol=0, atol=16 * ULP[dtype])


def _check_rope(got, x, positions, rotary, dtype):
    """got [T, n, rope] against x rotated in float64 (cos/sin rounded to the dtype, as both paths
    do): within the three roundings (two products, the sum) of the terms' magnitude
    |x1 cos| + |x2 sin|, each at most half a unit in the last place. The twin rounds each product
    and the kernel's may be contracted into an FMA, so near-cancelling results differ from the
    twin's by a rounding of the terms; a wrong pairing, position or frequency is off by the terms."""
    assert not got.isnan().any(), "unwritten rope values"
    cos, sin = rotary.cos_sin(positions)
    c, s = (t.to(dtype).double()[:, None, :] for t in (cos, sin))
    x64 = x.double()
    x1, x2 = (x64[..., 0::2], x64[..., 1::2]) if rotary.style == "gptj" else x64.chunk(2, dim=-1)
    halves = (x1 * c - x2 * s, x2 * c + x1 * s)
    bounds = [3 * ULP[dtype] * (a.abs() + b.abs()) + 1e-6 for a, b in ((x1 * c, x2 * s), (x2 * c, x1 * s))]
    if rotary.style == "gptj":
        want, bound = torch.stack(halves, -1).flatten(-2), torch.stack(bounds, -1).flatten(-2)
    else:
        want, bound = torch.cat(halves, -1), torch.cat(bounds, -1)
    excess = (got.double() - want).abs() - bound
    assert (excess <= 0).all(), f"RoPE off by up to {excess.max().item():.3g} past three roundings of the terms"


def _relative_error(got, want, dtype):
    assert not got.isnan().any(), "unwritten or NaN output"
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < MATMUL_REL_ERROR[dtype], f"relative error {rel}"


@pytest.mark.parametrize("style", ["gptj", "neox"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_latent_write(num_tokens, dtype, style):
    seed, block_size = _seed(), 16
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    norm = RMSNorm(RANK, 1e-6, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(RANK, generator=gen, device=DEVICE))
    fused_out = (torch.randn(num_tokens, 2048 + RANK + ROPE, generator=gen, device=DEVICE) * 3).to(dtype)
    kv_a = fused_out[:, 2048:]  # [T, rank + rope], strided as fused_qkv_a_proj's slice
    positions = torch.randint(0, 163840, (num_tokens,), generator=gen, device=DEVICE)
    num_blocks = num_tokens // block_size + 4
    blocks = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    t = torch.arange(num_tokens, device=DEVICE)
    slots = blocks[t // block_size] * block_size + t % block_size
    slots[3::5] = -1  # padded rows
    cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"), dtype=dtype, device=DEVICE)
    want = cache.clone()
    rotary = _rotary(style)
    with reports_seed(seed):
        latent_write_torch(kv_a, positions, norm, rotary, want, slots)
        latent_write_triton(kv_a, positions, norm, rotary, cache, slots)
        assert torch.equal(cache.isnan(), want.isnan()), "written slots differ"
        _near(cache[..., :RANK], want[..., :RANK], dtype)
        keep = slots >= 0
        written = cache.view(-1, RANK + ROPE)[slots[keep]]  # [written tokens, rank + rope]
        _check_rope(written[:, None, RANK:], kv_a[keep, None, RANK:], positions[keep], rotary, dtype)


def _kv_b(gen, dtype, heads=HEADS):  # [heads * (nope + v), rank]
    return (torch.randn(heads * (NOPE + V), RANK, generator=gen, device=DEVICE) / RANK**0.5).to(dtype)


@pytest.mark.parametrize("heads", [HEADS, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 1000])
def test_absorb_query_and_project_values(num_tokens, dtype, heads):
    seed = _seed()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w_uk, w_uv = split_kv_b(_kv_b(gen, dtype, heads), heads, NOPE, V)
    fused_out = torch.randn(num_tokens, heads * (NOPE + ROPE) + RANK + ROPE, generator=gen, device=DEVICE).to(dtype)
    q = fused_out[:, : heads * (NOPE + ROPE)].view(num_tokens, heads, NOPE + ROPE)
    positions = torch.randint(0, 163840, (num_tokens,), generator=gen, device=DEVICE)
    rotary = _rotary()
    o_lat = (torch.randn(num_tokens, heads, RANK, generator=gen, device=DEVICE)).to(dtype)
    with reports_seed(seed):
        q_abs = absorb_query_triton(q, w_uk, positions, rotary)
        want = absorb_query_torch(q, w_uk, positions, rotary)
        _relative_error(q_abs[..., :RANK], want[..., :RANK], dtype)
        _check_rope(q_abs[..., RANK:], q[..., NOPE:], positions, rotary, dtype)
        _relative_error(project_values_triton(o_lat, w_uv), project_values_torch(o_lat, w_uv), dtype)


# ------------------------------------------------------------------ the backend and the layer


def paged_batch(specs, block_size, dtype, gen, extra_blocks=0):
    """(cache, metadata, positions) for sequences (cached prefix, query length); prefixes random,
    every other slot NaN."""
    blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
    num_blocks = sum(blocks_per_seq) + 1 + extra_blocks
    order = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE).to(torch.int32)
    table = torch.full((len(specs), max(blocks_per_seq) + 1), num_blocks - 1, dtype=torch.int32, device=DEVICE)
    cache = torch.full((num_blocks, block_size, RANK + ROPE), float("nan"), dtype=dtype, device=DEVICE)
    used, qsl, new_slots, positions = 0, [0], [], []
    for i, (prefix, q_len) in enumerate(specs):
        table[i, : blocks_per_seq[i]] = order[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        t = torch.arange(prefix + q_len, device=DEVICE)
        slots = table[i, t // block_size].long() * block_size + t % block_size
        cache.view(-1, RANK + ROPE)[slots[:prefix]] = torch.randn(prefix, RANK + ROPE, generator=gen,
                                                                  device=DEVICE).to(dtype)
        new_slots.append(slots[prefix:])
        positions.append(t[prefix:])
        qsl.append(qsl[-1] + q_len)
    seq_lens = [p + q for p, q in specs]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table, slot_mapping=torch.cat(new_slots), block_size=block_size,
        max_query_len=max(q for _, q in specs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return cache, md, torch.cat(positions)


def mla_layers(dtype, gen, q_lora_rank=None):
    """V2-Lite's MLAAttention (or with a q LoRA) behind the torch and the Triton backend, same
    random weights."""
    dims = MLADims(hidden_size=HIDDEN, num_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=RANK,
                   qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V)
    rotary = _rotary()
    layers = [MLAAttention(dims, rotary, (NOPE + ROPE) ** -0.5, name, dtype=dtype, device=DEVICE)
              for name in ("torch", "triton")]
    with torch.no_grad():
        for param in layers[0].parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            value = torch.randn(param.shape, generator=gen, device=DEVICE) / fan_in**0.5
            param.copy_(1 + 0.2 * value if param.dim() == 1 else value)
        layers[1].load_state_dict(layers[0].state_dict())
    assert isinstance(layers[1].attn.backend, TritonMLABackend)
    return layers


MIXED = [(0, 300), (1000, 1), (517, 4), (2047, 1), (64, 200), (0, 1)]


@pytest.mark.parametrize("q_lora_rank", [None, 1536], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_forward_matches_torch_backend(dtype, q_lora_rank):
    seed = _seed()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    torch_layer, triton_layer = mla_layers(dtype, gen, q_lora_rank)
    cache, md, positions = paged_batch(MIXED, 16, dtype, gen)
    hidden = torch.randn(md.num_tokens, HIDDEN, generator=gen, device=DEVICE).to(dtype)
    caches = [cache.clone(), cache.clone()]
    torch_layer.attn.bind_kv_cache(caches[0])
    triton_layer.attn.bind_kv_cache(caches[1])
    with reports_seed(seed):
        want = torch_layer(positions, hidden, md)
        got = triton_layer(positions, hidden, md)
        _near_cache(caches[1], caches[0], dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 2e-2, f"relative error {rel}"


def test_mla_forward_no_sync_and_graph_replay():
    """Verify-shaped step (4 sequences x 4 tokens) and a decode step with padding rows, captured
    in CUDA graphs; replayed with new hidden states, positions, lengths, blocks and contexts."""
    seed = _seed()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    torch_layer, layer = mla_layers(torch.bfloat16, gen)
    with reports_seed(seed):
        graph_case(torch_layer, layer, [(700, 4), (1500, 4), (30, 4), (3000, 4)], 0, gen)
        graph_case(torch_layer, layer, [(900, 1), (40, 1)], 2, gen)


def graph_case(torch_layer, layer, specs, pad, gen, block_size=16):
    dtype = torch.bfloat16
    cache, md, positions = paged_batch(specs, block_size, dtype, gen)
    n = md.num_tokens + pad
    static_cache = torch.full((600, block_size, RANK + ROPE), float("nan"), dtype=dtype, device=DEVICE)
    hidden = torch.randn(n, HIDDEN, generator=gen, device=DEVICE).to(dtype)
    static_positions = torch.zeros(n, dtype=torch.int64, device=DEVICE)  # padding rows: position 0
    static_md = AttentionMetadata(
        query_start_loc=md.query_start_loc.clone(), seq_lens=md.seq_lens.clone(),
        block_table=torch.zeros(len(specs), 300, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=DEVICE),  # padding rows: -1
        block_size=block_size, max_query_len=md.max_query_len, max_seq_len=4096,
        query_start_loc_cpu=md.query_start_loc_cpu, seq_lens_cpu=md.seq_lens_cpu,
    )

    def load(cache, md, positions):
        static_cache.fill_(float("nan"))
        static_cache[: cache.shape[0]].copy_(cache)
        static_positions[: md.num_tokens].copy_(positions)
        static_md.slot_mapping[: md.num_tokens].copy_(md.slot_mapping)
        static_md.block_table.zero_()
        static_md.block_table[:, : md.block_table.shape[1]].copy_(md.block_table)
        static_md.query_start_loc.copy_(md.query_start_loc)
        static_md.seq_lens.copy_(md.seq_lens)

    layer.attn.bind_kv_cache(static_cache)
    load(cache, md, positions)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_positions, hidden, static_md)  # compiles every kernel before capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(static_positions, hidden, static_md)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_positions, hidden, static_md)
    for replay in range(2):
        new_specs = [(p + 37 * (replay + 1), q) for p, q in specs]
        cache2, md2, positions2 = paged_batch(new_specs, block_size, dtype, gen)
        hidden2 = torch.randn(md2.num_tokens, HIDDEN, generator=gen, device=DEVICE).to(dtype)
        load(cache2, md2, positions2)
        hidden[: md2.num_tokens].copy_(hidden2)
        graph.replay()
        cache_ref = cache2.clone()
        torch_layer.attn.bind_kv_cache(cache_ref)
        want = torch_layer(positions2, hidden2, md2)
        _near_cache(static_cache[: cache_ref.shape[0]], cache_ref, dtype)
        assert static_cache[cache_ref.shape[0]:].isnan().all(), f"padding rows wrote the cache (replay {replay})"
        torch.testing.assert_close(static_out[: md2.num_tokens].float(), want.float(), rtol=3e-2, atol=3e-2)
