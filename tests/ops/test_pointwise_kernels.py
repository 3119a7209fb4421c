"""The fused Triton kernels (residual add + RMSNorm, neox RoPE, SiLU-and-mul) held against their
torch twins, the layers' own torch paths.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (fp16 and fp32; the
interpreter keeps bf16 as uint16, so bf16 is checked on CUDA in tests/gpu). TRITON_INTERPRET is
set here, by the test harness, only while this module imports and runs: the library never reads
it. Outputs are poisoned with NaN before each launch, so a kernel that skips an element shows
it. Every case draws fresh random inputs; a failure prints the seed that reproduces it.

Where the kernel rounds exactly where the twin does (the residual add, every RoPE product and
sum) the outputs must be equal; the norm (a float32 reduction in another order) and silu (another
exp) may differ by a rounding of the dtype that went the other way.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed  # noqa: E402
from foretell.ops.common import kernel_choice
from foretell.layers.activation import SiluAndMul
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
fk = import_interpreted("foretell.ops.pointwise.triton_kernels")


DTYPES = [torch.float16, torch.float32]
# A rounding of the dtype that went the other way, carried through one more rounding (the norm's
# weight multiply, silu's `* up`): up to 2 units in the last place, plus room near zero.
NEAR = {torch.float16: dict(rtol=4e-3, atol=1e-5), torch.float32: dict(rtol=1e-6, atol=1e-7)}


def _rand(gen: torch.Generator, *shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _assert_written_and_close(got, expected, dtype, exact: bool):
    assert not torch.isnan(got).any(), "kernel left poisoned elements"
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    if exact:
        assert torch.equal(got, expected), f"max diff {(got.float() - expected.float()).abs().max()}"
    else:
        torch.testing.assert_close(got, expected, **NEAR[dtype])


# ---------------------------------------------------------------------- residual add + RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 4096 + 64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_torch(dtype, hidden, with_residual):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    num_tokens = random.Random(seed).randint(1, 7)
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_rand(gen, hidden, dtype=dtype))
    x = _rand(gen, num_tokens, hidden, dtype=dtype, scale=3.0)
    residual = _rand(gen, num_tokens, hidden, dtype=dtype, scale=3.0) if with_residual else None
    expected, expected_residual = norm._norm(x if residual is None else residual + x), (
        x if residual is None else residual + x
    )
    out = _poisoned(x.shape, dtype)
    residual_out = _poisoned(x.shape, dtype) if with_residual else None
    with reports_seed(seed):
        normed, new_residual = fk.rms_norm_triton(x, norm.weight, norm.eps, residual, out, residual_out)
        assert normed is out
        _assert_written_and_close(normed, expected, dtype, exact=False)
        if with_residual:
            assert new_residual is residual_out
            _assert_written_and_close(new_residual, expected_residual, dtype, exact=True)
        else:
            assert new_residual is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_on_a_qkv_view(dtype):
    """Qwen3's q_norm/k_norm: [tokens, heads, head_dim] views into the fused qkv output."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_tokens, num_kv_heads, head_dim = rng.randint(2, 9), rng.choice([1, 2, 3]), rng.choice([64, 128, 80])
    num_heads = num_kv_heads * rng.choice([1, 3, 4])
    qkv = _rand(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    norm = RMSNorm(head_dim, eps=1e-6, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_rand(gen, head_dim, dtype=dtype))
    with reports_seed(seed):
        for view in (q, k):
            assert not view.is_contiguous()
            out = _poisoned(view.shape, dtype)
            normed, same = fk.rms_norm_triton(view, norm.weight, norm.eps, out=out)
            assert same is view
            _assert_written_and_close(normed, norm._norm(view), dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_writes_the_new_residual_into_a_strided_column_block(dtype):
    """run_decoder_stack's aux states: a layer's input norm writes the stream into a column block
    [tokens, hidden] of a [tokens, aux, hidden] buffer (row stride aux * hidden), nothing else."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    hidden = 96
    norm = RMSNorm(hidden, eps=1e-6, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_rand(gen, hidden, dtype=dtype))
    x, residual = _rand(gen, 5, hidden, dtype=dtype), _rand(gen, 5, hidden, dtype=dtype, scale=3.0)
    streams = _poisoned((5, 3, hidden), dtype)
    with reports_seed(seed):
        normed, new_residual = fk.rms_norm_triton(x, norm.weight, norm.eps, residual, residual_out=streams[:, 1])
        assert new_residual.data_ptr() == streams[:, 1].data_ptr()
        _assert_written_and_close(streams[:, 1].contiguous(), residual + x, dtype, exact=True)
        assert torch.isnan(streams[:, 0]).all() and torch.isnan(streams[:, 2]).all()
        _assert_written_and_close(normed, norm._norm(residual + x), dtype, exact=False)
        twin_streams = torch.zeros(5, 3, hidden, dtype=dtype, device=DEVICE)  # the torch path does the same
        _, twin_residual = norm(x, residual, residual_out=twin_streams[:, 1])
        assert twin_residual.data_ptr() == twin_streams[:, 1].data_ptr()
        assert torch.equal(twin_streams[:, 1], residual + x)


def test_rms_norm_rejects_mismatched_inputs():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        fk.rms_norm_triton(x, torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fk.rms_norm_triton(x, torch.ones(8), 1e-6, torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        fk.rms_norm_triton(x, torch.ones(8), 1e-6, out=torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="residual_out must be"):
        fk.rms_norm_triton(x, torch.ones(8), 1e-6, torch.zeros(2, 8), residual_out=torch.zeros(2, 3, 8)[:, 0, :4])


# ---------------------------------------------------------------------- RoPE

ROPE_CASES = {
    # name: (num_heads, num_kv_heads, head_dim, rotary_dim, scaling)
    "llama_gqa": (8, 2, 128, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen_odd_heads": (7, 1, 64, 64, None),
    "partial_rotary": (6, 3, 128, 32, None),  # rotary_dim / 2 = 16
    "partial_rotary_non_pow2": (5, 5, 80, 48, {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 256}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_matches_torch(dtype, case, style):
    num_heads, num_kv_heads, head_dim, rotary_dim, scaling = ROPE_CASES[case]
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    num_tokens = random.Random(seed).randint(1, 6)
    max_positions = 4096
    rotary = RotaryEmbedding(rotary_dim, max_positions, 500000.0, scaling, style, device=DEVICE)
    # q and k as the model makes them: strided views into the fused qkv projection.
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand(gen, num_tokens, q_width + 2 * kv_width, dtype=dtype, scale=2.0)
    query = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(DEVICE)
    expected_q, expected_k = rotary(positions, query, key)  # CPU: the torch path
    q_out, k_out = _poisoned(query.shape, dtype), _poisoned(key.shape, dtype)
    with reports_seed(seed):
        got_q, got_k = fk.rope_triton(
            positions, query, key, rotary.cos_cache, rotary.sin_cache, q_out, k_out, style=style
        )
        assert got_q is q_out and got_k is k_out
        _assert_written_and_close(got_q, expected_q, dtype, exact=True)
        _assert_written_and_close(got_k, expected_k, dtype, exact=True)


# ---------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [96, 1000, 2048 + 24])
def test_silu_and_mul_matches_torch(dtype, intermediate):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    leading = rng.choice([(rng.randint(1, 5),), (2, rng.randint(1, 3))])
    gate_up = _rand(gen, *leading, 2 * intermediate, dtype=dtype, scale=4.0)
    expected = SiluAndMul()(gate_up)  # CPU: the torch path
    out = _poisoned(expected.shape, dtype)
    with reports_seed(seed):
        assert fk.silu_and_mul_triton(gate_up, out) is out
        _assert_written_and_close(out, expected, dtype, exact=False)


def test_silu_and_mul_on_a_strided_view():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    wide = _rand(gen, 3, 2 * 100 + 17, dtype=torch.float16, scale=4.0)
    gate_up = wide[:, 17:]  # rows strided, last dim contiguous
    with reports_seed(seed):
        _assert_written_and_close(
            fk.silu_and_mul_triton(gate_up), SiluAndMul()(gate_up), torch.float16, exact=False
        )


# ---------------------------------------------------------------------- dispatch


def test_layers_use_the_torch_path_off_cuda_and_under_autograd():
    assert not kernel_choice.use_triton(torch.zeros(2))
    if HAS_CUDA:
        x = torch.zeros(2, device="cuda", requires_grad=True)
        assert kernel_choice.use_triton(x.detach())
        assert not kernel_choice.use_triton(x)
        assert not kernel_choice.use_triton(x.detach(), torch.zeros(2))
        with torch.no_grad():
            assert kernel_choice.use_triton(x)


def test_layers_dispatch_to_the_kernels(monkeypatch):
    """With use_triton forced on (interpreter on the CPU), each layer's result is its kernel's,
    and matches the layer's torch path."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    calls = []
    for name in ("rms_norm_triton", "rope_triton", "silu_and_mul_triton"):
        kernel = getattr(fk, name)
        monkeypatch.setattr(fk, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))

    norm = RMSNorm(96, dtype=dtype, device=DEVICE)
    x, residual = _rand(gen, 3, 96, dtype=dtype), _rand(gen, 3, 96, dtype=dtype)
    rotary = RotaryEmbedding(32, 64, 10000.0, device=DEVICE)
    q, k = _rand(gen, 3, 4, 32, dtype=dtype), _rand(gen, 3, 2, 32, dtype=dtype)
    positions = torch.tensor([0, 5, 63], device=DEVICE)
    gate_up = _rand(gen, 3, 2 * 40, dtype=dtype)
    with reports_seed(seed):
        fused = (norm(x, residual), rotary(positions, q, k), SiluAndMul()(gate_up))
        assert calls == ["rms_norm_triton", "rope_triton", "silu_and_mul_triton"]
        monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: False)
        plain = (norm(x, residual), rotary(positions, q, k), SiluAndMul()(gate_up))
        assert len(calls) == 3
        for got, expected in zip(
            [*fused[0], *fused[1], fused[2]], [*plain[0], *plain[1], plain[2]]
        ):
            _assert_written_and_close(got, expected, dtype, exact=False)


def test_gptj_style_dispatches_interleaved(monkeypatch):
    """DeepSeek's interleaved RoPE goes to the kernel with style="gptj", rotating MLA's q_pe and
    its single shared k_pe (views into the projections) as the torch path does."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    styles = []
    kernel = fk.rope_triton
    monkeypatch.setattr(fk, "rope_triton", lambda *a, **kw: styles.append(kw["style"]) or kernel(*a, **kw))
    rotary = RotaryEmbedding(16, 32, 10000.0, style="gptj", device=DEVICE)
    q = torch.randn(2, 3, 24, device=DEVICE, dtype=torch.float16)
    k_pe = torch.randn(2, 40, device=DEVICE, dtype=torch.float16)[:, 24:].unsqueeze(1)
    positions = torch.tensor([1, 30], device=DEVICE)
    got_q, got_k = rotary(positions, q[..., 8:], k_pe)
    assert styles == ["gptj"]
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: False)
    expected_q, expected_k = rotary(positions, q[..., 8:], k_pe)
    for got, expected in ((got_q, expected_q), (got_k, expected_k)):
        if HAS_CUDA:  # the GPU contracts RoPE's products into FMAs: a rounding either way (tests/gpu)
            torch.testing.assert_close(got, expected, **NEAR[torch.float16])
        else:
            assert torch.equal(got, expected)


def test_rope_refuses_an_unknown_style():
    cache = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="rope style 'halves' is not one of"):
        fk.rope_triton(torch.zeros(1, dtype=torch.long), torch.zeros(1, 2, 16), torch.zeros(1, 1, 16),
                       cache, cache, style="halves")


def test_empty_batches():
    hidden = 32
    normed, residual = fk.rms_norm_triton(
        torch.zeros(0, hidden), torch.ones(hidden), 1e-6, torch.zeros(0, hidden)
    )
    assert normed.shape == residual.shape == (0, hidden)
    cache = torch.zeros(8, 8)
    q, k = fk.rope_triton(torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, 16),
                          torch.zeros(0, 1, 16), cache, cache)
    assert q.shape == (0, 2, 16) and k.shape == (0, 1, 16)
    assert fk.silu_and_mul_triton(torch.zeros(0, 10)).shape == (0, 5)
