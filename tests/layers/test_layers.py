"""Layer-level tests: weight loaders (fusing, shape checks, dtype by value), RMSNorm, SiluAndMul,
embedding tying, RoPE (config parsing and values against transformers), and the model registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foretell.layers.activation import SiluAndMul
from foretell.layers.embedding import LMHead, VocabEmbedding
from foretell.layers.linear import Linear, MergedLinear, QKVLinear
from foretell.layers.weight_loaders import default_weight_loader
from foretell.layers.norm import RMSNorm
from foretell.layers.rotary import FREQUENCY_BUILDERS, RotaryEmbedding, rope_parameters_from_config
from foretell.models.base import HFConfig
from foretell.models.registry import MODEL_REGISTRY, resolve_model_class
from foretell.ops.pointwise.reference import apply_rope_neox


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ linear loaders


def test_default_loader_shape_mismatch_names_shapes():
    layer = Linear(8, 4)
    with pytest.raises(ValueError, match=r"expected shape \(4, 8\), found shape \(8, 4\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 4), None)


def test_dtype_conversion_is_by_value():
    bf16 = torch.randn(4, 8, generator=_gen()).to(torch.bfloat16)
    layer32 = Linear(8, 4, dtype=torch.float32)
    default_weight_loader(layer32.weight, bf16)
    assert torch.equal(layer32.weight, bf16.float())  # exact: bf16 values are float32 values
    f32 = torch.randn(4, 8, generator=_gen(1))
    layer16 = Linear(8, 4, dtype=torch.bfloat16)
    default_weight_loader(layer16.weight, f32)
    assert torch.equal(layer16.weight, f32.to(torch.bfloat16))  # rounded, not bit-cast


def test_qkv_linear_places_shards_and_matches_separate_projections():
    hidden, head_dim, heads, kv_heads = 16, 4, 4, 2
    layer = QKVLinear(hidden, head_dim, heads, kv_heads, bias=True)
    assert layer.weight.shard_ids == ("q", "k", "v")
    parts = {
        "q": (torch.randn(16, 16, generator=_gen(1)), torch.randn(16, generator=_gen(2))),
        "k": (torch.randn(8, 16, generator=_gen(3)), torch.randn(8, generator=_gen(4))),
        "v": (torch.randn(8, 16, generator=_gen(5)), torch.randn(8, generator=_gen(6))),
    }
    for shard in ("v", "q", "k"):  # any order
        weight, bias = parts[shard]
        layer.weight.weight_loader(layer.weight, weight, shard)
        layer.bias.weight_loader(layer.bias, bias, shard)
    x = torch.randn(3, hidden, generator=_gen(7))
    q, k, v = layer.split(layer(x))
    for out, shard in ((q, "q"), (k, "k"), (v, "v")):
        torch.testing.assert_close(out, F.linear(x, *parts[shard]))


def test_qkv_linear_rejects_bad_shard_and_shape():
    layer = QKVLinear(16, 4, 4, 2)
    expected = r"shard 'k': expected shape \(8, 16\), found shape \(16, 16\)"
    with pytest.raises(ValueError, match=expected):
        layer.weight.weight_loader(layer.weight, torch.zeros(16, 16), "k")
    with pytest.raises(ValueError, match=r"shards \['q', 'k', 'v'\].*'x'"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 16), "x")


def test_merged_linear_gate_up():
    layer = MergedLinear(8, [6, 6])
    gate = torch.randn(6, 8, generator=_gen(1)).to(torch.bfloat16)
    up = torch.randn(6, 8, generator=_gen(2)).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]).float())
    with pytest.raises(ValueError, match=r"shard 1: expected shape \(6, 8\), found shape \(6, 9\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 9), 1)


# ----------------------------------------------------------------------- norm, act, embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    weight = (1 + 0.1 * torch.randn(32, generator=_gen(1))).to(dtype)
    ours = RMSNorm(32, 1e-5, dtype=dtype)
    ours.weight.weight_loader(ours.weight, weight)
    hf = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    x = (3 * torch.randn(5, 32, generator=_gen(2))).to(dtype)
    residual = torch.randn(5, 32, generator=_gen(3)).to(dtype)
    normed, new_residual = ours(x)
    assert torch.equal(normed, hf(x)) and new_residual is x
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, hf(residual + x))


def test_silu_and_mul():
    x = torch.randn(3, 10, generator=_gen())
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_tied_lm_head_shares_the_embedding_parameter():
    embedding = VocabEmbedding(10, 4)
    head = LMHead(10, 4, tie_to=embedding)
    assert head.weight is embedding.weight
    embedding.weight.weight_loader(embedding.weight, torch.randn(10, 4, generator=_gen()))
    hidden = torch.randn(2, 4, generator=_gen(1)).to(torch.bfloat16)
    embedding.to(torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (2, 10)
    with pytest.raises(ValueError, match="cannot tie"):
        LMHead(11, 4, tie_to=embedding)


# ----------------------------------------------------------------------------------- rotary

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_cos_sin(scaling, theta, head_dim, positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=131072,
    )
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]  # [T, head_dim]


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING],
    ids=["default", "linear", "llama3"],
)
def test_rope_cos_sin_match_hf(scaling):
    head_dim, theta = 16, 500000.0
    positions = torch.tensor([0, 1, 7, 100, 4097, 70000, 131071])
    rotary = RotaryEmbedding(head_dim, 131072, theta, scaling)
    cos, sin = rotary.cos_sin(positions)
    hf_cos, hf_sin = _hf_cos_sin(scaling, theta, head_dim, positions)
    torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_apply_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = RotaryEmbedding(16, 4096, 10000.0)
    positions = torch.tensor([3, 0, 9, 2000])
    q = torch.randn(4, 3, 16, generator=_gen(1)).to(dtype)  # [T, H, D]
    k = torch.randn(4, 1, 16, generator=_gen(2)).to(dtype)
    ours_q, ours_k = rotary(positions, q, k)
    cos, sin = rotary.cos_sin(positions)
    full_cos, full_sin = torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)
    # HF wants [B, H, T, D] with cos [B, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos[None], full_sin[None]
    )
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


def test_partial_rotary_leaves_the_rest_unchanged():
    rotary = RotaryEmbedding(8, 64, 10000.0)
    x = torch.randn(3, 2, 16, generator=_gen())
    q, _ = rotary(torch.tensor([1, 2, 3]), x, x)
    assert torch.equal(q[..., 8:], x[..., 8:])
    cos, sin = rotary.cos_sin(torch.tensor([1, 2, 3]))
    assert torch.equal(q[..., :8], apply_rope_neox(x[..., :8], cos, sin))


def test_rope_cache_is_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rotary = RotaryEmbedding(16, 128, 1e6, LLAMA3_SCALING)
    finally:
        torch.set_default_dtype(previous)
    assert rotary.cos_cache.dtype == torch.float32 and rotary.inv_freq.dtype == torch.float32
    reference = RotaryEmbedding(16, 128, 1e6, LLAMA3_SCALING)
    assert torch.equal(rotary.cos_cache, reference.cos_cache)


def test_rope_config_parsing_spellings():
    # transformers 4 / published configs: rope_scaling + top-level rope_theta, "type" key
    theta, params = rope_parameters_from_config(
        HFConfig({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}})
    )
    assert theta == 1e6 and params["rope_type"] == "linear" and params["factor"] == 2.0
    # transformers 5: rope_parameters holding rope_theta
    theta, params = rope_parameters_from_config(
        HFConfig({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_SCALING}})
    )
    assert theta == 5e5 and params["rope_type"] == "llama3"
    theta, params = rope_parameters_from_config(HFConfig({"rope_scaling": None}))
    assert theta == 10000.0 and params == {"rope_type": "default"}


def test_rope_unsupported_type_names_file_and_choices():
    config = HFConfig({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "/m/config.json")
    with pytest.raises(ValueError, match=r"/m/config.json.*'dynamic'.*default, linear, llama3"):
        rope_parameters_from_config(config)
    assert set(FREQUENCY_BUILDERS) >= {"default", "linear", "llama3"}


def test_rope_missing_scaling_field():
    with pytest.raises(ValueError, match="low_freq_factor"):
        RotaryEmbedding(16, 64, 1e4, {"rope_type": "llama3", "factor": 8.0})


# --------------------------------------------------------------------------------- registry


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_registry_resolves(arch):
    cls = resolve_model_class(HFConfig({"architectures": [arch]}))
    assert cls.__name__ == arch


def test_registry_unsupported_architecture_error():
    config = HFConfig({"architectures": ["GPT2LMHeadModel"]}, "/models/gpt2/config.json")
    with pytest.raises(ValueError) as info:
        resolve_model_class(config)
    message = str(info.value)
    assert "/models/gpt2/config.json" in message and "GPT2LMHeadModel" in message
    for arch in MODEL_REGISTRY:
        assert arch in message
    with pytest.raises(ValueError, match="no 'architectures' field"):
        resolve_model_class(HFConfig({}, "/x/config.json"))
