"""The fused MLA kernels (ops/mla/triton_fused.py, triton_latent_write.py) held against their torch
twins, and a whole MLAAttention forward with the Triton backend against the torch backend.

  latent write     RMSNorm of c + RoPE of k_pe + cache write at slot_mapping, from a strided kv_a
                   view; padded rows (slot -1) leave the NaN-poisoned cache untouched.
  absorb query     q_nope . W_UK and RoPE of q_pe into one q_abs buffer, from a strided q view.
  project values   o_lat . W_UV^T.
Both rope styles (neox, gptj) and a YaRN-scaled table; T = 1, 3 and a prefill-sized 40; tokens
spread over several cache blocks in random order.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (fp16 and fp32; the
interpreter's bf16 tl.dot is wrong, so bf16 is checked in tests/gpu/test_mla_fused_gpu.py).
Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.layers.mla import MLAAttention, MLADims
from foretell.ops.mla import reference
from foretell.ops.mla.reference import split_kv_b
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding

if torch.cuda.is_available():
    pytest.skip("on a GPU the kernels are tested in tests/gpu/test_mla_fused_gpu.py", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.mla.triton_rope")
latent_write = import_interpreted("foretell.ops.mla.triton_latent_write")
fused = import_interpreted("foretell.ops.mla.triton_fused")
import_interpreted("foretell.ops.mla.triton_attention")
mla_backend = import_interpreted("foretell.ops.mla.triton_backend")

SMALL = dict(num_heads=4, nope=16, rope=8, rank=32, v=16)
V2_LITE = dict(num_heads=16, nope=128, rope=64, rank=512, v=128)
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
ROTARIES = {"neox": ("neox", None), "gptj": ("gptj", None), "gptj-yarn": ("gptj", YARN)}
# Kernels and twins round at the same points; what is left is a reduction order (the norm's mean
# of squares, the matmuls' sums): one rounding of the dtype.
TOLERANCE = {torch.float16: 2e-3, torch.float32: 2e-5}


def _seed() -> int:
    return random.randrange(2**31)


def rotary(name: str, rope: int) -> RotaryEmbedding:
    style, scaling = ROTARIES[name]
    return RotaryEmbedding(rope, 4096, 10000.0, scaling, style)


def paged_slots(num_tokens: int, block_size: int, gen: torch.Generator, num_blocks: int) -> torch.Tensor:
    """[num_tokens] int64 slots of consecutive positions in blocks handed out in random order."""
    needed = -(-num_tokens // block_size)
    blocks = torch.randperm(num_blocks, generator=gen)[:needed]
    t = torch.arange(num_tokens)
    return blocks[t // block_size] * block_size + t % block_size


def kv_a_view(num_tokens, rank, rope, dtype, gen, q_width=24):
    """The kv_a slice of a fused_qkv_a_proj output: [T, rank + rope] with a row stride past it."""
    fused_out = torch.randn(num_tokens, q_width + rank + rope, generator=gen).to(dtype)
    return fused_out[:, q_width:]


def assert_close(got, want, dtype, what, seed):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True,
                               msg=lambda m: f"{what} (seed {seed}): {m}")


# ------------------------------------------------------------------------------ latent write


def check_latent_write(num_tokens, dtype, rotary_name, dims=SMALL, block_size=8, pad_rows=()):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    rank, rope = dims["rank"], dims["rope"]
    norm = RMSNorm(rank, 1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(rank, generator=gen))
    rope_emb = rotary(rotary_name, rope)
    kv_a = kv_a_view(num_tokens, rank, rope, dtype, gen) * 3
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    num_blocks = -(-num_tokens // block_size) + 3
    slots = paged_slots(num_tokens, block_size, gen, num_blocks)
    slots[list(pad_rows)] = -1
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=dtype)
    want = cache.clone()
    reference.latent_write_torch(kv_a, positions, norm, rope_emb, want, slots)
    latent_write.latent_write_triton(kv_a, positions, norm, rope_emb, cache, slots)
    assert torch.equal(cache.isnan(), want.isnan()), f"written slots differ (seed {seed})"
    assert (~cache.isnan()).flatten(0, 1).any(-1).sum() == int((slots >= 0).sum()), f"seed {seed}"
    assert_close(cache, want, dtype, "latent write", seed)
    if dtype != torch.float32:  # only the mean of squares' order differs: rarely a rounding flip
        written = ~want.isnan()
        mismatched = (cache[written] != want[written]).float().mean().item()
        assert mismatched < 0.01, f"{mismatched:.2%} of the written values differ (seed {seed})"


@pytest.mark.parametrize("rotary_name", list(ROTARIES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_latent_write_matches_twin(num_tokens, dtype, rotary_name):
    check_latent_write(num_tokens, dtype, rotary_name)


def test_latent_write_skips_padded_rows():
    check_latent_write(40, torch.float16, "gptj", pad_rows=(0, 7, 39))
    check_latent_write(3, torch.float32, "neox", pad_rows=(1,), block_size=1)


def test_latent_write_v2_lite_sizes():
    check_latent_write(3, torch.float16, "gptj-yarn", dims=V2_LITE, block_size=2)


# ------------------------------------------------------------------------ per-head matmuls


def kv_b_weight(dims, dtype, gen):  # [heads * (nope + v), rank]
    rows = dims["num_heads"] * (dims["nope"] + dims["v"])
    return (torch.randn(rows, dims["rank"], generator=gen) / dims["rank"] ** 0.5).to(dtype)


def check_absorb_query(num_tokens, dtype, rotary_name, dims=SMALL):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    heads, nope, rope, rank = dims["num_heads"], dims["nope"], dims["rope"], dims["rank"]
    w_uk, _ = split_kv_b(kv_b_weight(dims, dtype, gen), heads, nope, dims["v"])
    fused_out = torch.randn(num_tokens, heads * (nope + rope) + rank + rope, generator=gen).to(dtype)
    q = fused_out[:, : heads * (nope + rope)].view(num_tokens, heads, nope + rope)  # strided view
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    rope_emb = rotary(rotary_name, rope)
    want = reference.absorb_query_torch(q, w_uk, positions, rope_emb)
    out = torch.full((num_tokens, heads, rank + rope), float("nan"), dtype=dtype)
    got = fused.absorb_query_triton(q, w_uk, positions, rope_emb, out=out)
    assert got is out and not out.isnan().any(), f"unwritten q_abs entries (seed {seed})"
    assert_close(got, want, dtype, "absorbed query", seed)
    # RoPE has no reduction: bit for bit.
    assert torch.equal(got[..., rank:], want[..., rank:]), f"q_pe RoPE (seed {seed})"


@pytest.mark.parametrize("rotary_name", list(ROTARIES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_absorb_query_matches_twin(num_tokens, dtype, rotary_name):
    check_absorb_query(num_tokens, dtype, rotary_name)


def check_project_values(num_tokens, dtype, dims=SMALL):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    heads, rank, v = dims["num_heads"], dims["rank"], dims["v"]
    _, w_uv = split_kv_b(kv_b_weight(dims, dtype, gen), heads, dims["nope"], v)
    o_lat = torch.randn(num_tokens, heads, rank, generator=gen).to(dtype)
    want = reference.project_values_torch(o_lat, w_uv)
    out = torch.full((num_tokens, heads, v), float("nan"), dtype=dtype)
    assert fused.project_values_triton(o_lat, w_uv, out=out) is out
    assert_close(out, want, dtype, "value projection", seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_project_values_matches_twin(num_tokens, dtype):
    check_project_values(num_tokens, dtype)


def test_matmuls_v2_lite_sizes():
    check_absorb_query(3, torch.float16, "gptj-yarn", dims=V2_LITE)
    check_project_values(3, torch.float16, dims=V2_LITE)


def test_odd_widths_and_tile_overrides():
    # Widths that are not powers of two, and several K steps / column blocks per head.
    dims = dict(num_heads=3, nope=24, rope=6, rank=40, v=20)
    check_absorb_query(5, torch.float32, "neox", dims=dims)
    check_project_values(5, torch.float32, dims=dims)
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    w_uk, w_uv = split_kv_b(kv_b_weight(SMALL, torch.float16, gen), 4, 16, 16)
    q = torch.randn(20, 4, 24, generator=gen).half()
    positions = torch.arange(20)
    rope_emb = rotary("gptj", 8)
    cfg = {"BLOCK_T": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    assert_close(fused.absorb_query_triton(q, w_uk, positions, rope_emb, config=cfg),
                 reference.absorb_query_torch(q, w_uk, positions, rope_emb), torch.float16, "tiles", seed)
    o_lat = torch.randn(20, 4, 32, generator=gen).half()
    assert_close(fused.project_values_triton(o_lat, w_uv, config=cfg),
                 reference.project_values_torch(o_lat, w_uv), torch.float16, "tiles", seed)


# ------------------------------------------------------------------- the whole MLA forward


def paged_batch(specs, width, block_size, dtype, gen):
    """(cache, metadata, positions) for sequences (cached prefix, query length): blocks in random
    order, prefixes random, every other slot NaN."""
    blocks_per_seq = [-(-(p + q) // block_size) for p, q in specs]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32)
    table = torch.full((len(specs), max(blocks_per_seq) + 1), num_blocks - 1, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype)
    used, qsl, new_slots, positions = 0, [0], [], []
    for i, (prefix, q_len) in enumerate(specs):
        n = blocks_per_seq[i]
        table[i, :n] = order[used : used + n]
        used += n
        t = torch.arange(prefix + q_len)
        slots = table[i, t // block_size].long() * block_size + t % block_size
        cache.flatten(0, 1)[slots[:prefix]] = torch.randn(prefix, width, generator=gen).to(dtype)
        new_slots.append(slots[prefix:])
        positions.append(t[prefix:])
        qsl.append(qsl[-1] + q_len)
    seq_lens = [p + q for p, q in specs]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table, slot_mapping=torch.cat(new_slots), block_size=block_size,
        max_query_len=max(q for _, q in specs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return cache, md, torch.cat(positions)


def mla_layers(dims, q_lora_rank, rotary_name, dtype, gen):
    """The same random MLAAttention weights behind the torch and the Triton backend."""
    mla_dims = MLADims(hidden_size=48, num_heads=dims["num_heads"], q_lora_rank=q_lora_rank,
                       kv_lora_rank=dims["rank"], qk_nope_head_dim=dims["nope"],
                       qk_rope_head_dim=dims["rope"], v_head_dim=dims["v"])
    rope_emb = rotary(rotary_name, dims["rope"])
    scale = (dims["nope"] + dims["rope"]) ** -0.5
    layers = [MLAAttention(mla_dims, rope_emb, scale, name, dtype=dtype) for name in ("torch", "triton")]
    with torch.no_grad():
        for param in layers[0].parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            value = torch.randn(param.shape, generator=gen) / fan_in**0.5
            if param.dim() == 1:
                value = 1 + 0.2 * value
            param.copy_(value)
        layers[1].load_state_dict(layers[0].state_dict())
    assert isinstance(layers[1].attn.backend, mla_backend.TritonMLABackend)
    return layers


FORWARD_BATCHES = {
    "decode": [(35, 1), (0, 1), (17, 1)],
    "verify": [(17, 3), (40, 4), (9, 2)],
    "prefill_chunk": [(24, 20), (0, 1)],  # a chunk past the absorbed form's limit with a cached prefix
}


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("kind", list(FORWARD_BATCHES))
def test_mla_forward_triton_matches_torch(kind, q_lora_rank):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32
    torch_layer, triton_layer = mla_layers(SMALL, q_lora_rank, "gptj-yarn", dtype, gen)
    cache, md, positions = paged_batch(FORWARD_BATCHES[kind], SMALL["rank"] + SMALL["rope"], 8, dtype, gen)
    hidden = torch.randn(md.num_tokens, 48, generator=gen).to(dtype)
    caches = [cache.clone(), cache.clone()]
    torch_layer.attn.bind_kv_cache(caches[0])
    triton_layer.attn.bind_kv_cache(caches[1])
    want = torch_layer(positions, hidden, md)
    got = triton_layer(positions, hidden, md)
    assert_close(caches[1], caches[0], dtype, "latent cache", seed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"MLA forward (seed {seed}): {m}")


def test_mla_forward_fp16_and_padded_rows():
    """fp16 verify, then the same batch with two CUDA-graph padding rows (slot -1) appended: the
    real rows' output and the cache are unchanged."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    torch_layer, triton_layer = mla_layers(SMALL, None, "gptj", dtype, gen)
    cache, md, positions = paged_batch(FORWARD_BATCHES["verify"], SMALL["rank"] + SMALL["rope"], 4, dtype, gen)
    hidden = torch.randn(md.num_tokens, 48, generator=gen).to(dtype)
    caches = [cache.clone(), cache.clone(), cache.clone()]
    torch_layer.attn.bind_kv_cache(caches[0])
    want = torch_layer(positions, hidden, md)
    triton_layer.attn.bind_kv_cache(caches[1])
    got = triton_layer(positions, hidden, md)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=lambda m: f"fp16 forward (seed {seed}): {m}")
    assert_close(caches[1], caches[0], dtype, "latent cache", seed)

    n = md.num_tokens
    padded_md = AttentionMetadata(**{**vars(md), "slot_mapping": torch.cat([md.slot_mapping, torch.tensor([-1, -1])])})
    triton_layer.attn.bind_kv_cache(caches[2])
    padded = triton_layer(torch.cat([positions, torch.zeros(2, dtype=positions.dtype)]),
                          torch.cat([hidden, hidden[:2]]), padded_md)
    assert torch.equal(caches[2].isnan(), caches[1].isnan()), f"padding wrote the cache (seed {seed})"
    assert torch.equal(caches[2].nan_to_num(), caches[1].nan_to_num()), f"seed {seed}"
    assert torch.equal(padded[:n], got), f"padding changed real rows (seed {seed})"


def test_bad_inputs_raise_value_errors():
    gen = torch.Generator().manual_seed(0)
    dims, dtype = SMALL, torch.float32
    heads, nope, rope, rank, v = (dims[k] for k in ("num_heads", "nope", "rope", "rank", "v"))
    norm, rope_emb = RMSNorm(rank, 1e-6, dtype=dtype), rotary("gptj", rope)
    kv_a = torch.randn(3, rank + rope, generator=gen)
    positions, slots = torch.arange(3), torch.arange(3)
    cache = torch.zeros(4, 8, rank + rope)
    with pytest.raises(ValueError, match="MLA cache"):
        latent_write.latent_write_triton(kv_a, positions, norm, rope_emb, torch.zeros(4, 8, rank + rope + 1), slots)
    with pytest.raises(ValueError, match="rotary"):
        latent_write.latent_write_triton(kv_a, positions, norm, rotary("gptj", rope + 2), cache, slots)
    with pytest.raises(ValueError, match="kv_a_layernorm.weight"):
        latent_write.latent_write_triton(kv_a.half(), positions, norm, rope_emb, cache.half(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        latent_write.latent_write_triton(kv_a, positions, norm, rope_emb, cache, slots[:2])
    w_uk, w_uv = split_kv_b(kv_b_weight(dims, dtype, gen), heads, nope, v)
    q = torch.randn(3, heads, nope + rope, generator=gen)
    with pytest.raises(ValueError, match="w_uk"):
        fused.absorb_query_triton(q, w_uk.half(), positions, rope_emb)
    with pytest.raises(ValueError, match="rope part"):
        fused.absorb_query_triton(q[..., : nope - 1], w_uk, positions, rope_emb)
    with pytest.raises(ValueError, match="out must be"):
        fused.absorb_query_triton(q, w_uk, positions, rope_emb, out=torch.empty(3, heads, rank))
    with pytest.raises(ValueError, match="w_uv"):
        fused.project_values_triton(torch.randn(3, heads + 1, rank), w_uv)

    backend = mla_backend.TritonMLABackend()
    cache, md, positions = paged_batch([(5, 3)], rank + rope, 8, dtype, gen)
    kv_b = kv_b_weight(dims, dtype, gen)
    args = dict(q=q, kv_a=kv_a, positions=positions, rotary_emb=rope_emb, kv_a_layernorm=norm,
                kv_b_weight=kv_b, kv_cache=cache, metadata=md, scale=0.1, v_head_dim=v)
    backend.attend_projections(**args)  # the good case runs
    for change, match in [
        (dict(kv_a=kv_a[:, :-1]), "kv_a must be"),
        (dict(q=q[..., :-2]), "kv_b_proj.weight"),
        (dict(kv_b_weight=kv_b[:-1]), "kv_b_proj.weight"),
        (dict(v_head_dim=v + 1), "kv_b_proj.weight"),
        (dict(kv_cache=cache[..., :-1]), "MLA cache"),
        (dict(kv_cache=cache.view(-1, 4, rank + rope)), "block_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            backend.attend_projections(**{**args, **change})
