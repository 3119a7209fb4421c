"""A catch-up whose rows draft nothing caches their keys and values alone (Eagle3Head.cache_kv,
layers/attention/kv_only.py): the draft cache afterwards equals, bit for bit, the one the whole
layer leaves (CPU; float32, bfloat16 and float16; several sequences of several lengths over a
block table out of order; a head whose norm comes before the residual; an FP8 cache; a partial
or GPT-J rotation; an MLA draft layer with and without a q LoRA); the engine takes the path
(greedy EAGLE3 output still equals plain output) and can be turned back to the whole layer;
bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fixtures.eagle3_steps import cpu_drafter
from foretell import LLM, SamplingParams
from foretell.layers.attention.kv_only import trailing_projection, write_rotated_kv
from foretell.layers.attention.layer import Attention
from foretell.layers.attention.qkv_block import attend_qkv
from foretell.layers.rotary import RotaryEmbedding
from foretell.models.base import HFConfig, ModelOptions
from foretell.models.eagle3 import Eagle3Head
from foretell.models.eagle3_mla import Eagle3MLAHead
from foretell.ops.attention.reference import TorchAttentionBackend
from foretell.spec_decode.eagle3 import Eagle3Proposer
from foretell.spec_decode.proposer import catch_up_metadata

DEFAULT_HEAD = os.path.join(os.path.dirname(__file__), "..", "..", "foretell", "default_models", "qwen3-eagle3")
BLOCK_SIZE, NUM_BLOCKS = 4, 96
# Sequences of a prompt chunk: (first position, rows): a whole prompt, a later chunk, one row, a chunk ending mid-block
SEQUENCES = ((0, 23), (6, 9), (40, 1), (13, 18))


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.dtype.is_floating_point and p.dim():  # (the KV scales, scalars, stay 1.0)
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1 + (p.dim() == 1)).to(p.dtype))


def _chunk(vocab: int, gen: torch.Generator, device="cpu"):
    """(metadata, ids [n], positions [n]) of SEQUENCES over a shuffled block table."""
    per_seq = NUM_BLOCKS // len(SEQUENCES)
    table = torch.randperm(NUM_BLOCKS, generator=gen).view(len(SEQUENCES), per_seq).to(torch.int32)
    starts, rows = [s for s, _ in SEQUENCES], [r for _, r in SEQUENCES]
    meta = catch_up_metadata(starts, rows, table, BLOCK_SIZE, BLOCK_SIZE)
    positions = torch.tensor([p for s, r in SEQUENCES for p in range(s, s + r)])
    return meta, torch.randint(0, vocab, (positions.shape[0],), generator=gen), positions


def _both_caches(cache: torch.Tensor, whole, alone) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache before, after whole(), after alone() from the same start)."""
    before = cache.clone()
    with torch.inference_mode():
        whole()
        want = cache.clone()
        cache.copy_(before)
        alone()
    return before, want, cache


def _head(config: dict, dtype: torch.dtype, cls=Eagle3Head, cache_dtype=None) -> Eagle3Head:
    gen = torch.Generator().manual_seed(3)
    options = ModelOptions(dtype, torch.device("cpu"), TorchAttentionBackend())
    head = cls(HFConfig(config), config["target_hidden_size"], 2048, options, has_embed=True, has_lm_head=True)
    _randomise(head, gen)
    head.prepare_cpu_input_table()
    attn = head.attention_layers()[0]
    cache = torch.randn(attn.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), generator=gen).to(cache_dtype or dtype)
    attn.bind_kv_cache(cache)
    return head


def _default_config(**changes) -> dict:
    with open(os.path.join(DEFAULT_HEAD, "config.json")) as f:
        return {**json.load(f), **changes}


def _check_head(head: Eagle3Head, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    meta, ids, positions = _chunk(head.vocab_size, gen)
    width = head.fc.weight.shape[1] // 3
    aux = [torch.randn(ids.shape[0], width, generator=gen).to(dtype) for _ in range(3)]
    cache = head.attention_layers()[0].kv_cache
    before, want, got = _both_caches(
        cache, lambda: head(ids, positions, head.combine(aux), meta),
        lambda: head.cache_kv(ids, positions, head.combine(aux), meta))
    assert not torch.equal(want.view(torch.uint8), before.view(torch.uint8))  # the step wrote something
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit (NaN-proof for FP8 bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("before_residual", [False, True])
def test_cache_equals_the_whole_layers(dtype, before_residual):
    head = _head(_default_config(norm_before_residual=before_residual), dtype)
    _check_head(head, dtype)


@pytest.mark.parametrize("changes", [
    {"num_key_value_heads": 4},  # no GQA
    {"num_key_value_heads": 1, "attention_bias": True},  # MQA, biased q|k|v
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}},
])
def test_cache_equals_the_whole_layers_other_heads(changes):
    _check_head(_head(_default_config(**changes), torch.float32), torch.float32)


def test_fp8_cache_takes_the_module_form():
    head = _head(_default_config(), torch.float32, cache_dtype=torch.float8_e4m3fn)
    attn = head.attention_layers()[0]
    attn.kv_scales.k_scale.data.fill_(0.5)  # a checkpoint's scales, read when the cache is bound
    attn.kv_scales.v_scale.data.fill_(0.25)
    attn.bind_kv_cache(attn.kv_cache)
    assert attn.kv_scales.values == (0.5, 0.25)
    _check_head(head, torch.float32)


@pytest.mark.parametrize("style,rotary_dim", [("neox", 16), ("gptj", 32), ("neox", 32)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_write_equals_the_blocks(style, rotary_dim, contiguous):
    """write_rotated_kv against attend_qkv's cache write, every form: the CPU block's (NeoX over whole
    heads), the rotation through the module (partial, GPT-J), a cache that is not contiguous."""
    heads, kv_heads, head_dim = 6, 2, 32
    gen = torch.Generator().manual_seed(5)
    rotary = RotaryEmbedding(rotary_dim, 512, 10000.0, None, style)
    attn = Attention(heads, head_dim, kv_heads, head_dim**-0.5, TorchAttentionBackend())
    shape = attn.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
    storage = torch.randn(shape[:-1] + (2 * head_dim,), generator=gen)
    attn.bind_kv_cache(storage[..., :head_dim] if not contiguous else storage[..., :head_dim].contiguous())
    meta, _, positions = _chunk(2, gen)
    qkv = torch.randn(positions.shape[0], (heads + 2 * kv_heads) * head_dim, generator=gen)
    q_size = heads * head_dim
    _, want, got = _both_caches(
        attn.kv_cache, lambda: attend_qkv(attn, qkv.clone(), positions, rotary, meta),
        lambda: write_rotated_kv(attn, qkv.clone()[:, q_size:], positions, rotary, meta))
    assert torch.equal(got, want)


def test_trailing_projection_forms():
    """The whole projection's columns (the CPU's form: bit for bit), or the rows alone (CUDA's: close)."""
    head = _head(_default_config(attention_bias=True), torch.float32)
    qkv = head.midlayer.self_attn.qkv_proj
    x = torch.randn(37, qkv.input_size)
    whole = qkv(x)[:, qkv.q_size:]
    assert torch.equal(trailing_projection(qkv, x, qkv.q_size), whole)
    for rows in (3, 37):  # the few-row GEMM and F.linear
        torch.testing.assert_close(trailing_projection(qkv, x[:rows], qkv.q_size, rows_alone=True), whole[:rows])


def test_bad_input():
    attn = Attention(4, 16, 2, 0.25, TorchAttentionBackend())
    rotary = RotaryEmbedding(16, 64, 10000.0)
    meta, _, positions = _chunk(2, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="no KV cache bound"):
        write_rotated_kv(attn, torch.zeros(positions.shape[0], 64), positions, rotary, meta)
    attn.bind_kv_cache(torch.zeros(attn.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)))
    with pytest.raises(ValueError, match="64 wide"):
        write_rotated_kv(attn, torch.zeros(positions.shape[0], 96), positions, rotary, meta)


MLA_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 256, "vocab_size": 300, "draft_vocab_size": 128, "target_hidden_size": 64,
}


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_head_caches_the_latents_alone(q_lora_rank, dtype):
    head = _head({**MLA_CONFIG, "q_lora_rank": q_lora_rank}, dtype, cls=Eagle3MLAHead)
    _check_head(head, dtype)


# ---------------------------------------------------------------- in the engine


PROMPTS = [{"prompt_token_ids": [11, 42, 7, 99, 3, 250, 18, 64, 5, 77, 31, 2]},
           {"prompt_token_ids": [5, 17, 200, 31, 9]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_engine_takes_the_path_and_greedy_equals_plain(qwen3_checkpoint, eagle3_head, monkeypatch):
    calls = {"cache_kv": 0, "whole": 0}
    cache_kv, whole = Eagle3Head.cache_kv, Eagle3Head.forward

    def spy(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(Eagle3Head, "cache_kv", spy("cache_kv", cache_kv))
    monkeypatch.setattr(Eagle3Head, "forward", spy("whole", whole))
    spec, _ = cpu_drafter(qwen3_checkpoint, eagle3_head, max_num_batched_tokens=4)  # prompts in chunks of 4
    got = _tokens(spec)
    assert calls["cache_kv"] >= 3 and calls["whole"] == 0  # every prompt chunk: keys and values only
    plain = LLM(qwen3_checkpoint, dtype="float32", device="cpu", num_kv_blocks=32, num_cpu_threads=1, max_num_seqs=1)
    assert got == _tokens(plain)
    monkeypatch.setattr(Eagle3Proposer, "kv_only_catch_up", False)  # the whole layer, as before
    before = dict(calls)
    assert _tokens(spec) == got
    assert calls["cache_kv"] == before["cache_kv"] and calls["whole"] > before["whole"]
