"""The fused Triton kernels on a CUDA device (bf16/fp16 at Llama-3.1-8B / Qwen3-8B sizes), held
against their torch twins run on the same device; the layers' dispatch (kernel under inference,
torch under autograd); no host sync in a launch; capture and replay in a CUDA graph; and whole
models whose greedy tokens do not change when the kernels replace the torch paths.

Where a kernel rounds exactly where its twin does (the residual add) the outputs must be
bit-equal; the norm (float32 reduction in another order, another rsqrt), silu (another exp) and
RoPE (the H200 run of 2026-11-29 showed its float32 products contracted into FMAs: bf16 results
one unit in the last place from torch's in some elements) may differ in a small fraction of
elements, by a rounding of the dtype that went the other way (up to 2 units in the last place).
Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch


from fixtures.seeds import reports_seed
from foretell import LLM, SamplingParams
from foretell.ops.common import kernel_choice
from foretell.ops.pointwise import triton_kernels as fk
from foretell.layers.activation import SiluAndMul
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]
# A rounding of the dtype that went the other way, carried through one more rounding (the
# norm's weight multiply, silu's `* up`): up to 2 units in the last place.
NEAR = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4), torch.float16: dict(rtol=4e-3, atol=1e-5)}
MAX_DIFFERING_FRACTION = 0.01  # of elements not bit-equal (norm, silu)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rand(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _torch_path():
    """Context in which the layers take their torch paths whatever the device."""
    return pytest.MonkeyPatch.context()


def _check(got, expected, dtype, exact):
    assert not torch.isnan(got).any(), "kernel left poisoned elements"
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous()
    if exact:
        diff = (got.float() - expected.float()).abs().max()
        assert torch.equal(got, expected), f"not bit-equal, max diff {diff}"
        return
    torch.testing.assert_close(got, expected, **NEAR[dtype])
    differing = (got != expected).float().mean().item()
    assert differing <= MAX_DIFFERING_FRACTION, f"{differing:.2%} of elements differ"


def _check_rope(got, x, cos, sin, rotary_dim, style="neox"):
    """x1 cos - x2 sin and x2 cos + x1 sin against float64: within two roundings of the terms'
    magnitude (|x1 cos| + |x2 sin|), or of the dtype's subnormal step. The torch path rounds each product to the dtype and the
    kernel fuses them, so near-cancelling elements differ by a rounding of the terms, not of
    the (small) result; a wrong index or frequency is off by the terms themselves."""
    assert not torch.isnan(got).any(), "kernel left poisoned elements"
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    half = rotary_dim // 2
    x64, c, s = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    if style == "gptj":  # pairs (2i, 2i + 1), results kept interleaved
        x1, x2 = x64[..., 0:rotary_dim:2], x64[..., 1:rotary_dim:2]
        pair = lambda a, b: torch.stack((a, b), dim=-1).flatten(-2)  # noqa: E731
    else:
        x1, x2 = x64[..., :half], x64[..., half:rotary_dim]
        pair = lambda a, b: torch.cat((a, b), dim=-1)  # noqa: E731
    tail = x64[..., rotary_dim:]
    exact = torch.cat((pair(x1 * c - x2 * s, x2 * c + x1 * s), tail), dim=-1)
    terms = torch.cat((pair((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), tail.abs()), -1)
    error = (got.double() - exact).abs()
    # Plus four of the dtype's subnormal steps: a product that small (fp16 below 6e-5) is rounded
    # to a fixed step, not relative to its size.
    info = torch.finfo(x.dtype)
    bound = 2 * info.eps * terms + 4 * info.smallest_normal * info.eps
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound (2 eps of the terms' magnitude)"
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:]), "the unrotated tail changed"


def _norm_reference(norm, x, residual):
    summed = x if residual is None else residual + x
    return norm._norm(summed), summed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_eagle3_input_at_llama8b_size(dtype, rows):
    """ops/pointwise/triton_eagle3_input.py: [input_layernorm(embed[ids]) ; hidden_norm(g)] against the
    draft layer's torch path (a 128256-row embedding, hidden 4096), and replayed in a CUDA graph."""
    from foretell.ops.pointwise.triton_eagle3_input import eagle3_input_triton

    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden, vocab = 4096, 128256
    embedding = _rand(gen, vocab, hidden, dtype=dtype, scale=0.02)
    norms = [RMSNorm(hidden, eps, dtype=dtype, device=DEVICE) for eps in (1e-5, 1e-6)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.1 * _rand(gen, hidden, dtype=dtype))
    ids = torch.randint(0, vocab, (rows,), generator=gen, device=DEVICE)
    g = _rand(gen, rows, hidden, dtype=dtype, scale=4.0)
    args = (ids, embedding, g, norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps)
    expected = torch.cat([norms[0]._norm(embedding[ids]), norms[1]._norm(g)], dim=-1)
    with reports_seed(seed):
        _check(eagle3_input_triton(*args), expected, dtype, exact=False)
        eagle3_input_triton(*args)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = eagle3_input_triton(*args)
        ids.copy_(torch.randint(0, vocab, (rows,), generator=gen, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        _check(captured, torch.cat([norms[0]._norm(embedding[ids]), norms[1]._norm(g)], dim=-1), dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
@pytest.mark.parametrize("hidden", [4096, 4096 + 64, 7168])
def test_rms_norm(dtype, num_tokens, hidden):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _rand(gen, hidden, dtype=dtype))
    x = _rand(gen, num_tokens, hidden, dtype=dtype, scale=2.0)
    residual = _rand(gen, num_tokens, hidden, dtype=dtype, scale=8.0)
    with reports_seed(seed):
        for res in (residual, None):
            expected, expected_residual = _norm_reference(norm, x, res)
            out, res_out = _nan(x.shape, dtype), _nan(x.shape, dtype)
            normed, new_residual = fk.rms_norm_triton(x, norm.weight, norm.eps, res, out, res_out)
            _check(normed, expected, dtype, exact=False)
            if res is not None:
                _check(new_residual, expected_residual, dtype, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 517])
def test_qwen3_per_head_norm(dtype, num_tokens):
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = _rand(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=3.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    norm = RMSNorm(head_dim, 1e-6, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _rand(gen, head_dim, dtype=dtype))
    with reports_seed(seed):
        for view in (q, k):
            normed, _ = fk.rms_norm_triton(view, norm.weight, norm.eps, out=_nan(view.shape, dtype))
            _check(normed, norm._norm(view), dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize(
    "heads,head_dim,rotary_dim,scaling",
    [((32, 8), 128, 128, LLAMA3_SCALING), ((32, 8), 128, 64, None), ((40, 8), 80, 40, None),
     ((14, 2), 64, 64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})],
)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_matches_float64(dtype, num_tokens, heads, head_dim, rotary_dim, scaling, style):
    num_heads, num_kv_heads = heads
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    max_positions = 32768
    rotary = RotaryEmbedding(rotary_dim, max_positions, 500000.0, scaling, style, device=DEVICE)
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand(gen, num_tokens, q_width + 2 * kv_width, dtype=dtype, scale=2.0)
    query = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen, device=DEVICE)
    cos, sin = rotary.cos_sin(positions)
    with reports_seed(seed):
        got = fk.rope_triton(positions, query, key, rotary.cos_cache, rotary.sin_cache,
                             _nan(query.shape, dtype), _nan(key.shape, dtype), style=style)
        for out, x in zip(got, (query, key)):
            _check_rope(out, x, cos, sin, rotary_dim, style)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 333])
@pytest.mark.parametrize("intermediate", [14336, 12288, 1000])
def test_silu_and_mul(dtype, num_tokens, intermediate):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up = _rand(gen, num_tokens, 2 * intermediate, dtype=dtype, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    with reports_seed(seed):
        out = fk.silu_and_mul_triton(gate_up, _nan(expected.shape, dtype))
        _check(out, expected, dtype, exact=False)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("shape", [(32, 8, 128, 128), (7, 1, 64, 64), (6, 3, 80, 48)])
def test_rope_and_kv_write_in_one_launch(shape, style, with_norm):
    """rope_write_kv_triton against the launches it replaces ((q_norm, k_norm,) rope_triton,
    write_kv_triton) in bf16, padded rows left alone, and captured in a CUDA graph."""
    from foretell.ops.attention.triton_rope_kv import rope_write_kv_triton
    from foretell.ops.attention.triton_write_kv import write_kv_triton

    num_heads, num_kv_heads, head_dim, rotary_dim = shape
    dtype, num_tokens = torch.bfloat16, 9
    rotary = RotaryEmbedding(rotary_dim, 8192, 500000.0, None, style, device=DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    query = query.view(num_tokens, num_heads, head_dim)
    key, value = key.view(num_tokens, num_kv_heads, head_dim), value.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    slots = torch.randperm(64 * 16, device=DEVICE)[:num_tokens]
    slots[3] = -1
    cache = torch.full((2, 64, 16, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    want_cache = cache.clone()
    qk_norm = None
    if with_norm:  # Qwen3: per-head RMSNorm before the rotation (a normed value may round the other way)
        qk_norm = (RMSNorm(head_dim, 1e-6, dtype=dtype, device=DEVICE), RMSNorm(head_dim, 1e-6, dtype=dtype, device=DEVICE))
        with torch.no_grad():
            for n in qk_norm:
                n.weight.normal_(1.0, 0.3)
    tolerance = dict(rtol=2e-2, atol=2e-2) if with_norm else {}

    def unfused():
        q, k = (qk_norm[0](query)[0], qk_norm[1](key)[0]) if with_norm else (query, key)
        want_q, want_k = fk.rope_triton(positions, q, k, rotary.cos_cache, rotary.sin_cache, style=style)
        write_kv_triton(want_k, value, want_cache, slots)
        return want_q

    def fused():
        return rope_write_kv_triton(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache, slots,
                                    style=style, qk_norm=qk_norm)

    with torch.inference_mode():
        torch.testing.assert_close(fused(), unfused(), **tolerance)
        torch.testing.assert_close(cache, want_cache, equal_nan=True, **tolerance)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_q = fused()
        positions.copy_(torch.randint(0, 8192, (num_tokens,), device=DEVICE))
        graph.replay()
        torch.testing.assert_close(graph_q, unfused(), **tolerance)
        torch.testing.assert_close(cache, want_cache, equal_nan=True, **tolerance)


def test_layers_dispatch_under_inference_only(monkeypatch):
    calls = []
    for name in ("rms_norm_triton", "rope_triton", "silu_and_mul_triton"):
        kernel = getattr(fk, name)
        monkeypatch.setattr(fk, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    dtype = torch.bfloat16
    norm = RMSNorm(256, dtype=dtype, device=DEVICE)
    rotary = RotaryEmbedding(64, 128, 10000.0, device=DEVICE)
    x = torch.randn(3, 256, device=DEVICE, dtype=dtype)
    q, k = torch.randn(3, 4, 64, device=DEVICE, dtype=dtype), torch.randn(3, 2, 64, device=DEVICE, dtype=dtype)
    positions = torch.tensor([0, 5, 100], device=DEVICE)
    gate_up = torch.randn(3, 64, device=DEVICE, dtype=dtype)
    with torch.inference_mode():
        norm(x, x)
        rotary(positions, q, k)
        SiluAndMul()(gate_up)
    assert calls == ["rms_norm_triton", "rope_triton", "silu_and_mul_triton"]
    # Training: parameters or activations needing grad keep the torch path (the kernels have no
    # backward), and gradients flow.
    norm.weight.requires_grad_(True)
    q.requires_grad_(True)
    gate_up.requires_grad_(True)
    loss = norm(x)[0].float().sum() + rotary(positions, q, k)[0].float().sum()
    loss = loss + SiluAndMul()(gate_up).float().sum()
    loss.backward()
    assert len(calls) == 3
    assert norm.weight.grad is not None and q.grad is not None and gate_up.grad is not None
    # gptj (DeepSeek's interleaved pairs) runs the same kernel.
    with torch.inference_mode():
        RotaryEmbedding(64, 128, 10000.0, style="gptj", device=DEVICE)(positions, q, k)
    assert calls[3:] == ["rope_triton"]


def _layer_step(norm, rotary, act, hidden, residual, positions, qkv, gate_up, num_heads, num_kv_heads, head_dim):
    n = hidden.shape[0]
    normed, new_residual = norm(hidden, residual)
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
    q, k = rotary(positions, q, k)
    return normed, new_residual, q, k, act(gate_up)


def test_launches_do_not_sync_and_replay_in_a_cuda_graph():
    dtype, n, hidden, heads, kv_heads, head_dim, inter = torch.bfloat16, 8, 4096, 32, 8, 128, 14336
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5, dtype=dtype, device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 131072, 500000.0, LLAMA3_SCALING, device=DEVICE)
    act = SiluAndMul()

    def inputs():
        return dict(
            hidden=_rand(gen, n, hidden, dtype=dtype), residual=_rand(gen, n, hidden, dtype=dtype),
            positions=torch.randint(0, 131072, (n,), generator=gen, device=DEVICE),
            qkv=_rand(gen, n, (heads + 2 * kv_heads) * head_dim, dtype=dtype),
            gate_up=_rand(gen, n, 2 * inter, dtype=dtype),
        )

    def step(t):
        return _layer_step(norm, rotary, act, **t, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)

    static = inputs()
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(static)  # compiles every kernel before the checks
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(static)
        with reports_seed(seed):
            for _ in range(2):
                fresh = inputs()
                for name, t in fresh.items():
                    static[name].copy_(t)
                graph.replay()
                expected = step(fresh)
                for got, want in zip(static_out, expected):
                    assert torch.equal(got, want)  # same kernels, same inputs


@pytest.mark.parametrize("checkpoint", ["qwen3_checkpoint", "llama31_checkpoint"])
def test_model_greedy_tokens_unchanged(checkpoint, request):
    """A whole model (float32, so tokens are stable against one-rounding differences) decodes the
    same tokens with the fused kernels as with the torch paths."""
    folder = request.getfixturevalue(checkpoint)
    prompts = ["The cat reads the book. The cat", "def add(x):\n    return", "Question:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate():
        llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=4)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = generate()
    with _torch_path() as mp:
        mp.setattr(kernel_choice, "use_triton", lambda *tensors: False)
        plain = generate()
    assert fused == plain
