"""RoPE + KV write in one launch (ops/attention/triton_rope_kv.py) held against its twin,
RotaryEmbedding.forward then write_kv_torch, in Triton's interpreter on CPU tensors (the real
kernel on a CUDA machine): GQA, odd head counts, partial rotary, both pairings, YaRN / llama3
scaling, padded rows (slot -1), tokens spread over cache blocks; Attention.forward_rotary's
dispatch; bad input.

q and k are rounded where the twin rounds them, so q and the cache must be equal, not close.
Outputs and caches start poisoned with NaN, so anything the kernel fails to write shows; every
case draws fresh random inputs and a failure names the seed.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.common import kernel_choice
from foretell.layers.attention.layer import Attention
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import write_kv_torch
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
import_interpreted("foretell.ops.pointwise.triton_kernels")
rkv = import_interpreted("foretell.ops.attention.triton_rope_kv")
import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402

CASES = {
    # name: (num_heads, num_kv_heads, head_dim, rotary_dim, scaling)
    "llama_gqa": (8, 2, 128, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "odd_heads": (7, 1, 64, 64, None),
    "partial_rotary": (6, 3, 80, 48, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
}
BLOCK_SIZE, NUM_BLOCKS = 4, 12


def _inputs(case, dtype, seed, num_tokens):
    num_heads, num_kv_heads, head_dim, rotary_dim, scaling = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as the model makes them: strided views into the fused qkv projection.
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (torch.randn(num_tokens, q_width + 2 * kv_width, generator=gen) * 2).to(dtype).to(DEVICE)
    query = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # one padded row
    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return query, key, value, positions, slots.to(DEVICE), cache


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_and_kv_write_match_the_twin(dtype, case, style):
    seed = random.randrange(2**31)
    num_tokens = random.Random(seed).randint(2, 9)
    query, key, value, positions, slots, cache = _inputs(case, dtype, seed, num_tokens)
    rotary = RotaryEmbedding(CASES[case][3], 4096, 500000.0, CASES[case][4], style, device=DEVICE)
    expected_q, expected_k = rotary(positions, query, key)  # CPU: the torch path
    expected_cache = cache.clone()
    real = slots >= 0  # the twin skips padded rows by leaving them out
    write_kv_torch(expected_k[real], value[real], expected_cache, slots[real])
    with reports_seed(seed):
        got_q = rkv.rope_write_kv_triton(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache,
                                         slots, style=style)
        assert torch.equal(got_q, expected_q)
        # Written slots equal the twin's; the rest (and the padded row's slot) still NaN.
        torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0, equal_nan=True)


# The norm's float32 sum runs in another order than torch's: a normed value may round the other
# way, and RoPE carries that one rounding on.
NORM_TOLERANCE = {torch.float16: dict(rtol=1e-2, atol=2e-3), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _qk_norm(head_dim, dtype, gen) -> tuple[RMSNorm, RMSNorm]:
    norms = (RMSNorm(head_dim, 1e-6, dtype=dtype, device=DEVICE), RMSNorm(head_dim, 1e-5, dtype=dtype, device=DEVICE))
    with torch.no_grad():
        for n in norms:
            n.weight.copy_((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype))
    return norms


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["odd_heads", "partial_rotary"])
def test_qwen3_qk_norm_before_the_rotation(dtype, case):
    """With (q_norm, k_norm): each head RMS-normed, then rotated, then written, in one launch."""
    seed = random.randrange(2**31)
    query, key, value, positions, slots, cache = _inputs(case, dtype, seed, 5)
    norms = _qk_norm(CASES[case][2], dtype, torch.Generator().manual_seed(seed))
    rotary = RotaryEmbedding(CASES[case][3], 4096, 1000000.0, CASES[case][4], device=DEVICE)
    expected_q, expected_k = rotary(positions, norms[0](query)[0], norms[1](key)[0])
    expected_cache = cache.clone()
    real = slots >= 0
    write_kv_torch(expected_k[real], value[real], expected_cache, slots[real])
    with reports_seed(seed):
        got_q = rkv.rope_write_kv_triton(positions, query, key, value, rotary.cos_cache, rotary.sin_cache, cache,
                                         slots, qk_norm=norms)
        torch.testing.assert_close(got_q, expected_q, **NORM_TOLERANCE[dtype])
        torch.testing.assert_close(cache, expected_cache, equal_nan=True, **NORM_TOLERANCE[dtype])


@pytest.mark.parametrize("with_norm", [False, True])
def test_forward_rotary_fuses_on_the_triton_backend(monkeypatch, with_norm):
    """Attention.forward_rotary with the kernels on, for a prefill (decode and short verify steps
    take one launch: tests/ops/test_attention_rope_paged.py): RoPE + KV write in one launch, and the
    same output and cache as (q_norm / k_norm,) RoPE, then forward."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    calls = []
    kernel = rkv.rope_write_kv_triton
    monkeypatch.setattr(rkv, "rope_write_kv_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    seed = random.randrange(2**31)
    dtype = torch.float16
    n = 20  # more query tokens than one attention program holds
    query, key, value, positions, _, cache = _inputs("llama_gqa", dtype, seed, n)
    rotary = RotaryEmbedding(128, 4096, 500000.0, CASES["llama_gqa"][4], device=DEVICE)
    qk_norm = _qk_norm(128, dtype, torch.Generator().manual_seed(seed)) if with_norm else None
    blocks = torch.arange(NUM_BLOCKS, dtype=torch.int32, device=DEVICE)[None, :]
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE), block_table=blocks,
        slot_mapping=torch.arange(n, device=DEVICE), block_size=BLOCK_SIZE, max_query_len=n, max_seq_len=n,
        query_start_loc_cpu=[0, n], seq_lens_cpu=[n],
    )
    layers = []
    for _ in range(2):
        layer = Attention(8, 128, 2, 128**-0.5, TritonAttentionBackend())
        layer.bind_kv_cache(cache.clone().nan_to_num_(0.0))
        layers.append(layer)
    with reports_seed(seed):
        fused = layers[0].forward_rotary(positions, query, key, value, rotary, md, qk_norm)
        assert calls == [1]
        q, k = query, key
        if qk_norm is not None:
            q, k = qk_norm[0](query)[0], qk_norm[1](key)[0]
        q, k = rotary(positions, q, k)
        plain = layers[1](q, k, value, md)
        tolerance = NORM_TOLERANCE[dtype] if with_norm else dict(rtol=0, atol=0)
        torch.testing.assert_close(layers[0].kv_cache, layers[1].kv_cache, **tolerance)
        torch.testing.assert_close(fused, plain, **tolerance)


def test_bad_input_is_refused():
    query, key, value, positions, slots, cache = _inputs("odd_heads", torch.float32, 0, 2)
    rotary = RotaryEmbedding(64, 4096, 10000.0, device=DEVICE)
    args = (rotary.cos_cache, rotary.sin_cache)
    with pytest.raises(ValueError, match="share a dtype"):
        rkv.rope_write_kv_triton(positions, query, key, value, *args, cache.half(), slots)
    with pytest.raises(ValueError, match="kv_cache must be"):
        rkv.rope_write_kv_triton(positions, query, key, value, *args, cache[0], slots)
    with pytest.raises(ValueError, match="rope style"):
        rkv.rope_write_kv_triton(positions, query, key, value, *args, cache, slots, style="llama")
    with pytest.raises(ValueError, match="matching tokens"):
        rkv.rope_write_kv_triton(positions, query[:1], key, value, *args, cache, slots)
    wrong = (RMSNorm(32, device=DEVICE), RMSNorm(64, device=DEVICE))
    with pytest.raises(ValueError, match="q_norm / k_norm"):
        rkv.rope_write_kv_triton(positions, query, key, value, *args, cache, slots, qk_norm=wrong)
