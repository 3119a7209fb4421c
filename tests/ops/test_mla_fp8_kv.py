"""FP8 latent cache for MLA (one k_scale per layer for the whole [c | k_pe] entry): the Triton latent
writes (plain and fused norm + RoPE + write) store the twin's e4m3 bytes, the absorbed attention
over an FP8 cache matches TorchMLABackend over the same cache (absorbed and expanded forms), and
FP8 stays close to a float32 cache of the same entries.

Triton's interpreter on CPU tensors (fp16 / fp32 queries); tests/gpu/test_kv_fp8_gpu.py runs the
kernels on CUDA in bf16.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from foretell.layers.norm import RMSNorm
from foretell.ops.attention.fp8_kv import FP8_E4M3, dequantize_from_cache, quantize_for_cache
from foretell.ops.mla import reference
from foretell.ops.mla.reference import TorchMLABackend

if torch.cuda.is_available():
    pytest.skip("on a GPU the kernels are tested in tests/gpu/test_kv_fp8_gpu.py", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401
from test_mla_attention import BATCHES, LONG, LatentBatch  # noqa: E402
from test_mla_fused import kv_a_view, paged_slots, rotary  # noqa: E402

import_interpreted("foretell.ops.pointwise.triton_kernels")
import_interpreted("foretell.ops.mla.triton_rope")
latent_write = import_interpreted("foretell.ops.mla.triton_latent_write")
import_interpreted("foretell.ops.mla.triton_fused")
mla_triton = import_interpreted("foretell.ops.mla.triton_attention")
mla_backend = import_interpreted("foretell.ops.mla.triton_backend")

K_SCALE = 0.25  # not 1: a scale applied twice or never shows


def _fp8(batch: LatentBatch, k_scale: float = K_SCALE) -> torch.Tensor:
    return quantize_for_cache(batch.cache, FP8_E4M3, k_scale)  # NaN poison stays NaN


def _same_bytes(a, b, what):
    assert a.dtype == b.dtype == FP8_E4M3
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: the stored e4m3 bytes differ"


def _reference_o_lat(batch: LatentBatch, cache: torch.Tensor, k_scale: float) -> torch.Tensor:
    """The absorbed attention's o_lat over the dequantized cache, in float32."""
    dequantized = dequantize_from_cache(cache, k_scale, torch.float32)
    q_lat, q_pe = batch.q_lat, batch.q_pe
    batch.q_lat, batch.q_pe = q_lat.float(), q_pe.float()
    try:
        from test_mla_attention import reference_o_lat

        return reference_o_lat(batch, dequantized)
    finally:
        batch.q_lat, batch.q_pe = q_lat, q_pe


@pytest.mark.parametrize("dtype, kind", [(torch.float16, "mixed"), (torch.float32, "prefill"),
                                         (torch.float16, "verify")], ids=str)
def test_latent_write_and_attention_over_fp8_match_torch(dtype, kind):
    seed = random.randrange(2**31)
    batch = LatentBatch(BATCHES[kind], 4, 32, 8, 8, dtype, seed)
    batch.latent, batch.k_pe = batch.latent * 40, batch.k_pe * 40  # some entries past 448 * k_scale
    md = batch.metadata
    cache, cache_ref = _fp8(batch), _fp8(batch)
    with reports_seed(seed):
        latent_write.write_latent_triton(batch.latent, batch.k_pe, cache, md.slot_mapping, K_SCALE)
        TorchMLABackend().write_kv(batch.latent, batch.k_pe, cache_ref, md.slot_mapping, K_SCALE)
        _same_bytes(cache, cache_ref, "write_latent_triton")
        out = torch.full_like(batch.q_lat, float("nan"))
        mla_triton.mla_attention_triton(batch.q_lat, batch.q_pe, cache, md.block_table, md.seq_lens,
                                        md.query_start_loc, md.max_query_len, batch.scale, out, k_scale=K_SCALE)
        assert not out.isnan().any(), "rows left unwritten or NaN read"
        expected = _reference_o_lat(batch, cache_ref, K_SCALE)
        # fp16: the scores of inputs scaled by 40 round at about 1e-3 of their size before the softmax
        # (seed 590159228 put one of 2,560 values 6.3e-3 off); fp32: the reference's own rounding of
        # those scores (seed 121167769 put one of 5,248 values 1.2e-4 off)
        tol = 1e-2 if dtype == torch.float16 else 1e-3
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_attention_over_fp8(num_splits):
    """k_scale multiplies every split's accumulator alike: the merge kernel keeps it once."""
    seed = random.randrange(2**31)
    batch = LatentBatch(LONG, 4, 32, 8, 16, torch.float16, seed)
    md = batch.metadata
    cache = _fp8(batch)
    with reports_seed(seed):
        latent_write.write_latent_triton(batch.latent, batch.k_pe, cache, md.slot_mapping, K_SCALE)
        out = torch.full_like(batch.q_lat, float("nan"))
        mla_triton.mla_attention_triton(batch.q_lat, batch.q_pe, cache, md.block_table, md.seq_lens,
                                        md.query_start_loc, md.max_query_len, batch.scale, out,
                                        num_splits=num_splits, k_scale=K_SCALE)
        torch.testing.assert_close(out.float(), _reference_o_lat(batch, cache, K_SCALE), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fused_latent_write_stores_the_twins_bytes(dtype):
    """Norm + RoPE + write into an FP8 cache. In fp16 the norm's mean of squares may sum in another
    order than the twin's and flip a rounding (test_mla_fused.py): then at most one e4m3 step."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rank, rope, block_size, num_tokens = 32, 8, 8, 19
    norm = RMSNorm(rank, 1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(rank, generator=gen))
    rope_emb = rotary("gptj", rope)
    kv_a = kv_a_view(num_tokens, rank, rope, dtype, gen) * 3
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    num_blocks = -(-num_tokens // block_size) + 3
    slots = paged_slots(num_tokens, block_size, gen, num_blocks)
    slots[[2, 7]] = -1
    cache = torch.zeros(num_blocks, block_size, rank + rope, dtype=FP8_E4M3)
    want = cache.clone()
    with reports_seed(seed):
        reference.latent_write_torch(kv_a, positions, norm, rope_emb, want, slots, K_SCALE)
        latent_write.latent_write_triton(kv_a, positions, norm, rope_emb, cache, slots, K_SCALE)
        if dtype == torch.float32:
            _same_bytes(cache, want, "latent_write_triton")
        else:
            differ = (cache.view(torch.uint8) != want.view(torch.uint8)).float().mean().item()
            assert differ < 0.01, f"{differ:.2%} of the stored bytes differ"
            torch.testing.assert_close(cache.float(), want.float(), rtol=0.13, atol=2.0**-9)


def test_backends_agree_over_fp8_and_stay_close_to_float32():
    """TritonMLABackend and TorchMLABackend (absorbed and expanded forms) over one FP8 cache agree;
    all stay close to the same entries in a float32 cache (e4m3 rounding of entries ~ N(0, 1),
    k_scale 1: over 100 seeds the mean error was 8.5e-3 on average, 1.07e-2 at most, against outputs
    of mean magnitude 0.3; bound 1.6e-2)."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    heads, nope, v, rank, rope = 4, 16, 12, 32, 8
    batch = LatentBatch(BATCHES["mixed"], heads, rank, rope, 8, torch.float32, seed)
    md = batch.metadata
    kv_b = torch.randn(heads * (nope + v), rank, generator=gen) / rank**0.5
    q_nope = torch.randn(md.num_tokens, heads, nope, generator=gen)
    full = batch.cache.clone()
    TorchMLABackend().write_kv(batch.latent, batch.k_pe, full, md.slot_mapping)
    cache = quantize_for_cache(full, FP8_E4M3, 1.0)
    args = (q_nope, batch.q_pe, kv_b, cache, md, batch.scale, v)
    with reports_seed(seed):
        triton_out = mla_backend.TritonMLABackend().attend(*args, k_scale=1.0)
        absorbed = TorchMLABackend().attend(*args, absorb=True, k_scale=1.0)
        expanded = TorchMLABackend().attend(*args, absorb=False, k_scale=1.0)
        torch.testing.assert_close(triton_out, absorbed, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(expanded, absorbed, rtol=1e-4, atol=1e-4)
        exact = TorchMLABackend().attend(q_nope, batch.q_pe, kv_b, full, md, batch.scale, v)
        error = (absorbed - exact).abs()
        assert error.mean() < 1.6e-2, (float(error.mean()), float(exact.abs().mean()))


def test_bad_k_scale_is_refused():
    batch = LatentBatch(BATCHES["decode"], 4, 32, 8, 8, torch.float32, 0)
    md = batch.metadata
    cache = _fp8(batch)
    with pytest.raises(ValueError, match="k_scale must be a finite positive number"):
        latent_write.write_latent_triton(batch.latent, batch.k_pe, cache, md.slot_mapping, -1.0)
    with pytest.raises(ValueError, match="k_scale must be a finite positive number"):
        mla_triton.mla_attention_triton(batch.q_lat, batch.q_pe, cache, md.block_table, md.seq_lens,
                                        md.query_start_loc, md.max_query_len, batch.scale,
                                        torch.empty_like(batch.q_lat), k_scale=float("inf"))
