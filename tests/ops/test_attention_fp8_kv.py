"""FP8 KV cache for GQA attention (ops/attention/fp8_kv.py): the Triton KV writes (plain, RoPE +
write, the one-launch RoPE + attention) store the same e4m3 bytes as the torch twin, the paged
attention over an FP8 cache matches the torch reference, and attention over an FP8 cache stays
close to attention over a full-precision cache of the same keys and values (bounded below).

Triton runs in its interpreter on CPU tensors with fp16 / fp32 queries (the interpreter's bf16
tl.dot is wrong); tests/gpu/test_kv_fp8_gpu.py runs the same comparisons on CUDA in bf16.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.layers.attention.layer import Attention
from foretell.ops.attention.fp8_kv import (
    FP8_E4M3,
    FP8_E4M3_MAX,
    dequantize_from_cache,
    kv_cache_torch_dtype,
    quantize_for_cache,
)
from foretell.ops.attention.reference import TorchAttentionBackend, write_kv_torch
from foretell.ops.common import kernel_choice
from test_attention_paged import BATCHES, LONG_BATCHES, Batch
from test_attention_rope_paged import Step

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
import_interpreted("foretell.ops.pointwise.triton_kernels")
kernels = import_interpreted("foretell.ops.attention.triton_paged")
write_kv = import_interpreted("foretell.ops.attention.triton_write_kv")
rkv = import_interpreted("foretell.ops.attention.triton_rope_kv")
fused = import_interpreted("foretell.ops.attention.triton_rope_paged")
from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# Kernel against reference over the same FP8 cache: only the order of float32 sums and the
# query's rounding for the dots differ.
KERNEL_TOLERANCE = {torch.float16: dict(rtol=5e-3, atol=5e-3), torch.float32: dict(rtol=1e-4, atol=1e-4)}
SCALES = (0.5, 2.0)  # k_scale, v_scale: neither 1, so a scale applied twice or never shows


def _fp8_cache(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """An FP8 copy of a Batch's cache (its NaN poison stays NaN)."""
    return torch.stack([quantize_for_cache(cache[0], FP8_E4M3, k_scale), quantize_for_cache(cache[1], FP8_E4M3, v_scale)])


def _same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype == FP8_E4M3
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: the stored e4m3 bytes differ"


def test_quantize_round_trip_clamps_and_scales():
    x = torch.tensor([0.0, 1.0, -3.3, 100.0, 447.0, 500.0, -1e6, 2.0**-9, 1e-5])
    stored = quantize_for_cache(x, FP8_E4M3, 1.0)
    back = dequantize_from_cache(stored, 1.0, torch.float32)
    assert not back.isnan().any(), "values past 448 must saturate, not become NaN"
    assert back[5] == FP8_E4M3_MAX and back[6] == -FP8_E4M3_MAX
    assert back[7] == 2.0**-9 and back[8] == 0.0  # the smallest subnormal; below half of it: zero
    normal = x[1:5]
    assert ((back[1:5] - normal).abs() <= normal.abs() * 2.0**-4).all()  # 3 mantissa bits: <= half an ulp
    # A scale: x / s is stored, x comes back (to e4m3's precision); 1000 fits with s = 4.
    stored = quantize_for_cache(torch.tensor([1000.0, -7.0]), FP8_E4M3, 4.0)
    torch.testing.assert_close(dequantize_from_cache(stored, 4.0, torch.float32), torch.tensor([1024.0, -7.0]))
    # Other caches store the model dtype and ignore the scale.
    assert torch.equal(quantize_for_cache(x.half(), torch.float16, 4.0), x.half())


def test_cache_dtype_names():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_E4M3
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8_E4M3
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'fp8_e5m2'"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_write_kv_stores_the_twins_bytes(dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    key = (torch.randn(9, 3, 64, generator=gen) * 200).to(dtype).to(DEVICE)  # some past 448 / k_scale
    value = torch.randn(9, 3, 64, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(48, generator=gen)[:9].to(DEVICE)
    slots[4] = -1  # a padded row writes nothing
    cache = torch.zeros(2, 6, 8, 3, 64, dtype=FP8_E4M3, device=DEVICE)
    expected = cache.clone()
    with reports_seed(seed):
        write_kv.write_kv_triton(key, value, cache, slots, *SCALES)
        real = slots >= 0
        write_kv_torch(key[real], value[real], expected, slots[real], *SCALES)
        _same_bytes(cache, expected, "write_kv_triton")


def _check_paged(batch: Batch, dtype, seed, **split):
    md = batch.metadata
    cache = _fp8_cache(batch.cache, *SCALES)
    reference_cache = cache.clone()
    with reports_seed(seed):
        write_kv.write_kv_triton(batch.key, batch.value, cache, md.slot_mapping, *SCALES)
        write_kv_torch(batch.key, batch.value, reference_cache, md.slot_mapping, *SCALES)
        _same_bytes(cache, reference_cache, "write_kv_triton")
        expected = TorchAttentionBackend().attend(batch.query, reference_cache, md, batch.scale, *SCALES)
        out = torch.full_like(batch.query, float("nan"))
        kernels.paged_attention_triton(batch.query, cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       md.max_query_len, batch.scale, out, k_scale=SCALES[0], v_scale=SCALES[1],
                                       **split)
        assert not out.isnan().any(), "rows left unwritten or NaN read"
        torch.testing.assert_close(out.float(), expected.float(), **KERNEL_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["mixed", "prefix_prefill"])
def test_paged_attention_over_fp8_matches_torch(kind, dtype):
    seed = random.randrange(2**31)
    batch = Batch(BATCHES[kind], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=dtype, seed=seed)
    _check_paged(batch, dtype, seed)


def test_split_context_over_fp8_matches_torch():
    """Split decode / verify: v_scale multiplies every partial alike, so the merge keeps it once."""
    seed = random.randrange(2**31)
    batch = Batch(LONG_BATCHES["verify"], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                  dtype=torch.float16, seed=seed)
    _check_paged(batch, torch.float16, seed, num_splits=4, min_split_tokens=1)


@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_kv_write_and_one_launch_attention_over_fp8(with_norm):
    """RoPE + KV write (two launches) stores the torch path's bytes; the one-launch kernel stores the
    same and attends like the two launches and the torch path."""
    dtype = torch.float16
    seed = random.randrange(2**31)
    step = Step(LONG_BATCHES["verify"], 2, 32, dtype, seed, with_norm=with_norm, padded=1)
    md = step.batch.metadata
    base = _fp8_cache(step.batch.cache, *SCALES)
    with reports_seed(seed):
        two_cache = base.clone()
        q = rkv.rope_write_kv_triton(step.positions, step.query, step.key, step.value, step.rotary.cos_cache,
                                     step.rotary.sin_cache, two_cache, md.slot_mapping, style=step.rotary.style,
                                     qk_norm=step.qk_norm, k_scale=SCALES[0], v_scale=SCALES[1])
        two = torch.full_like(q, float("nan"))
        kernels.paged_attention_triton(q, two_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       md.max_query_len, step.batch.scale, two, k_scale=SCALES[0],
                                       v_scale=SCALES[1], num_splits=4, min_split_tokens=1)
        one_cache = base.clone()
        one = fused.rope_paged_attention_triton(
            step.positions, step.query, step.key, step.value, step.rotary.cos_cache, step.rotary.sin_cache,
            one_cache, md.slot_mapping, md.block_table, md.seq_lens, md.query_start_loc, md.max_query_len,
            step.batch.scale, style=step.rotary.style, qk_norm=step.qk_norm, num_splits=4, min_split_tokens=1,
            k_scale=SCALES[0], v_scale=SCALES[1])
        # the torch path: norm, RoPE, write_kv_torch, TorchAttentionBackend
        qt, kt = step.query, step.key
        if step.qk_norm is not None:
            qt, kt = step.qk_norm[0](qt)[0], step.qk_norm[1](kt)[0]
        qt, kt = step.rotary(step.positions, qt, kt)
        torch_cache = base.clone()
        real = md.slot_mapping >= 0
        write_kv_torch(kt[real], step.value[real], torch_cache, md.slot_mapping[real], *SCALES)
        expected = TorchAttentionBackend().attend(qt, torch_cache, md, step.batch.scale, *SCALES)
        if DEVICE.type == "cpu":
            _same_bytes(two_cache, torch_cache, "rope_write_kv_triton")
            _same_bytes(one_cache, torch_cache, "rope_paged_attention_triton")
        live = step.live_rows()
        tolerance = dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(one[live].float(), two[live].float(), **tolerance)
        torch.testing.assert_close(one[live].float(), expected[live].float(), **tolerance)


def test_layer_runs_the_one_launch_kernel_over_fp8(monkeypatch):
    """Attention.forward_rotary with an FP8 cache bound takes the fused decode kernel with the
    layer's scales, and equals the torch backend's layer over the same cache."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    calls = []
    kernel = fused.rope_paged_attention_triton
    monkeypatch.setattr(fused, "rope_paged_attention_triton", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    seed = random.randrange(2**31)
    step = Step(BATCHES["decode"], 4, 64, torch.float16, seed)
    base = _fp8_cache(step.batch.cache, *SCALES)
    layers = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        layer = Attention(8, 64, 2, step.batch.scale, backend)
        layer.kv_scales.k_scale.data.fill_(SCALES[0])
        layer.kv_scales.v_scale.data.fill_(SCALES[1])
        layer.bind_kv_cache(base.clone())
        layers.append(layer)
    with reports_seed(seed):
        got = layers[0].forward_rotary(step.positions, step.query, step.key, step.value, step.rotary,
                                       step.batch.metadata)
        assert len(calls) == 1 and (calls[0]["k_scale"], calls[0]["v_scale"]) == SCALES
        monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: False)
        expected = layers[1].forward_rotary(step.positions, step.query, step.key, step.value, step.rotary,
                                            step.batch.metadata)
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
        if DEVICE.type == "cpu":
            _same_bytes(layers[0].kv_cache, layers[1].kv_cache, "the layers' caches")


@pytest.mark.parametrize("kind", ["prefill", "verify", "decode"])
def test_fp8_cache_attention_stays_close_to_full_precision(kind):
    """The same keys and values in a float32 cache and in an FP8 cache (scale 1.0): the outputs
    differ by e4m3's rounding only. Queries, keys and values ~ N(0, 1.5^2), head_dim 64 (peaked
    softmax rows, which magnify key errors), outputs of mean magnitude about 0.8: over 150 seeds
    per kind the mean error was at most 0.032 (typically 0.027) and the largest 0.49 (typically
    0.3); bounds 0.045 and 0.75. A v_scale off by 10% already moves the mean by more."""
    seed = random.randrange(2**31)
    batch = Batch(BATCHES[kind], num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=torch.float32,
                  seed=seed)
    md = batch.metadata
    full = batch.cache.clone()
    write_kv_torch(batch.key, batch.value, full, md.slot_mapping)
    fp8 = _fp8_cache(full, 1.0, 1.0)
    backend = TorchAttentionBackend()
    reference = backend.attend(batch.query, full, md, batch.scale)
    error = (backend.attend(batch.query, fp8, md, batch.scale) - reference).abs()
    wrong = (backend.attend(batch.query, fp8, md, batch.scale, v_scale=1.1) - reference).abs()
    with reports_seed(seed):
        assert error.mean() < 0.045 and error.max() < 0.75, (float(error.mean()), float(error.max()))
        assert wrong.mean() > error.mean() + 0.03


def test_bad_scales_and_query_dtype_are_refused():
    batch = Batch(BATCHES["decode"], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32,
                  seed=0)
    md = batch.metadata
    cache = _fp8_cache(batch.cache, 1.0, 1.0)
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="k_scale must be a finite positive number"):
        write_kv.write_kv_triton(batch.key, batch.value, cache, md.slot_mapping, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale must be a finite positive number"):
        kernels.paged_attention_triton(batch.query, cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       md.max_query_len, batch.scale, out, v_scale=float("nan"))
    with pytest.raises(ValueError, match="must be bfloat16, float16 or float32"):
        kernels.paged_attention_triton(batch.query.double(), cache, md.block_table, md.seq_lens,
                                       md.query_start_loc, md.max_query_len, batch.scale, out.double())
