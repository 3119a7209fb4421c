"""The torch (CPU) path's few-launch forms hold the arithmetic of the plain formulas they replace:
RMSNorm through torch.rms_norm and with per-head weights, RoPE from the paired table, q/k norm
and RoPE over the query and key heads side by side, and the batched-matmul attention (decode rows
without a mask, one sequence without an output buffer), against straightforward references."""

from __future__ import annotations

import pytest
import torch

from foretell.layers.attention.layer import norm_and_rotate
from foretell.ops.attention.reference import TorchAttentionBackend, causal_attention, gather_context
from foretell.layers.norm import RMSNorm, rms_norm_torch
from foretell.layers.rotary import RotaryEmbedding
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.pointwise.reference import apply_rope_gptj, apply_rope_neox


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _hf_rms_norm(x, weight, eps):  # transformers' LlamaRMSNorm, weight broadcast against x
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 256), (7, 64), (3, 6, 64), (2, 1000)])
def test_rms_norm_torch_is_hf_bit_for_bit(dtype, shape):
    x = (3 * torch.randn(*shape, generator=_gen(1))).to(dtype)
    weight = torch.randn(shape[-1], generator=_gen(2)).to(dtype)
    assert torch.equal(rms_norm_torch(x, weight, 1e-6), _hf_rms_norm(x, weight, 1e-6))
    if len(shape) == 3:  # per-head weights (q_norm and k_norm side by side)
        per_head = torch.randn(shape[1], shape[2], generator=_gen(3)).to(dtype)
        assert torch.equal(rms_norm_torch(x, per_head, 1e-6), _hf_rms_norm(x, per_head, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotate_heads_is_apply_rope_neox_bit_for_bit(dtype):
    rotary = RotaryEmbedding(64, 2048, 10000.0)
    for num_tokens in (1, 4, 33):
        positions = torch.randint(0, 2048, (num_tokens,), generator=_gen(num_tokens))
        x = torch.randn(num_tokens, 6, 64, generator=_gen(7)).to(dtype)
        cos, sin = rotary.cos_sin(positions)
        assert torch.equal(rotary.rotate_heads(positions, x), apply_rope_neox(x, cos, sin))


def test_rotate_heads_other_layouts_use_the_plain_functions():
    positions = torch.tensor([0, 5, 17])
    x = torch.randn(3, 2, 16, generator=_gen())
    gptj = RotaryEmbedding(16, 64, 10000.0, style="gptj")
    cos, sin = gptj.cos_sin(positions)
    assert torch.equal(gptj.rotate_heads(positions, x), apply_rope_gptj(x, cos, sin))
    partial = RotaryEmbedding(8, 64, 10000.0)  # rotates the first 8 of 16 channels
    cos, sin = partial.cos_sin(positions)
    out = partial.rotate_heads(positions, x)
    assert torch.equal(out[..., :8], apply_rope_neox(x[..., :8], cos, sin))
    assert torch.equal(out[..., 8:], x[..., 8:])


def _qk_norms(dtype, k_eps=1e-6):
    q_norm, k_norm = RMSNorm(64, 1e-6, dtype=dtype), RMSNorm(64, k_eps, dtype=dtype)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=_gen(4)))
        k_norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=_gen(5)))
    return q_norm, k_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_eps", [1e-6, 1e-5], ids=["same-eps", "own-eps"])
def test_norm_and_rotate_equals_the_modules_in_turn(dtype, k_eps):
    rotary = RotaryEmbedding(64, 2048, 10000.0)
    q_norm, k_norm = _qk_norms(dtype, k_eps)
    for num_tokens in (1, 5):
        positions = torch.arange(100, 100 + num_tokens)
        qkv = torch.randn(num_tokens, 512, generator=_gen(num_tokens)).to(dtype)  # Qwen3-like q|k|v
        q, k, _ = qkv.split([256, 128, 128], dim=-1)
        q, k = q.view(num_tokens, 4, 64), k.view(num_tokens, 2, 64)
        want_q, want_k = rotary(positions, q_norm(q)[0], k_norm(k)[0])
        got_q, got_k = norm_and_rotate(positions, q, k, rotary, (q_norm, k_norm))
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        want_q, want_k = rotary(positions, q, k)  # no q/k norm (Llama)
        got_q, got_k = norm_and_rotate(positions, q, k, rotary, None)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def _reference_attention(query, key, value, scale):  # float64, one head at a time, explicit mask
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q_len, num_heads, value.shape[-1], dtype=torch.float64)
    for h in range(num_heads):
        k, v = key[:, h // group].double(), value[:, h // group].double()
        scores = query[:, h].double() @ k.T * scale  # [q_len, seq_len]
        for j in range(q_len):
            scores[j, seq_len - q_len + j + 1:] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ v
    return out


@pytest.mark.parametrize("heads", [(4, 2, 64, 64), (8, 8, 16, 16), (4, 1, 40, 32)], ids=["gqa", "mha", "mla-like"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_causal_attention_matches_the_reference(heads, q_len):
    num_heads, num_kv_heads, head_dim, v_dim = heads
    for seq_len in (q_len, 9, 70):
        query = torch.randn(q_len, num_heads, head_dim, generator=_gen(seq_len))
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=_gen(seq_len + 1))
        value = torch.randn(seq_len, num_kv_heads, v_dim, generator=_gen(seq_len + 2))
        got = causal_attention(query, key, value, head_dim**-0.5)
        assert got.shape == (q_len, num_heads, v_dim) and got.dtype == query.dtype
        torch.testing.assert_close(got.double(), _reference_attention(query, key, value, head_dim**-0.5),
                                   rtol=1e-5, atol=1e-5)
    bf16 = causal_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), 0.125)
    assert bf16.dtype == torch.bfloat16


def _metadata(seq_lens, query_lens, block_table, block_size):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def test_attend_one_sequence_and_a_batch_agree_with_per_sequence_gathers():
    num_blocks, block_size, num_kv_heads, head_dim, num_heads = 24, 16, 2, 64, 4
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=_gen())
    block_table = torch.randperm(num_blocks, generator=_gen(1)).to(torch.int32).view(3, 8)
    seq_lens, query_lens = [37, 5, 100], [1, 4, 3]
    backend = TorchAttentionBackend()
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=_gen(2))
    batch_out = backend.attend(query, cache, _metadata(seq_lens, query_lens, block_table, block_size), 0.125)
    row = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        key = gather_context(cache[0], block_table[i], seq_len)
        value = gather_context(cache[1], block_table[i].long(), seq_len)  # int64 rows gather alike
        want = causal_attention(query[row:row + q_len], key, value, 0.125)
        one = backend.attend(query[row:row + q_len], cache,
                             _metadata([seq_len], [q_len], block_table[i:i + 1], block_size), 0.125)
        assert torch.equal(one, want) and torch.equal(batch_out[row:row + q_len], want)
        row += q_len
