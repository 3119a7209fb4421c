"""EAGLE3 heads: both public layouts load; the engine's draft logits equal a plain-torch reference
written from the published description; aux-layer conventions; config validation."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from fixtures.eagle3 import write_eagle3_head
from foretell import LLM
from foretell.spec_decode.eagle3 import resolve_aux_layers
from foretell.models.base import HFConfig
from foretell.spec_decode.proposer import catch_up_metadata


def rms(x, w, eps=1e-6):
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):  # x [T, heads, d], neox rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None]  # [T, d/2]
    cos, sin = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_head(state, config, embed, aux, tokens, positions, g=None):
    """One EAGLE3 step over T causal rows, from the description in the issue (float32).
    Returns (draft logits [T, Vd], h before the final norm [T, H])."""
    p = {k.replace("layers.0.", "midlayer."): v.float() for k, v in state.items()}
    H, nh, nkv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    if g is None:
        g = torch.cat(aux, dim=-1) @ p["fc.weight"].T  # [T, H]
    e = embed[tokens].float()
    x = torch.cat([rms(e, p["midlayer.input_layernorm.weight"]), rms(g, p["midlayer.hidden_norm.weight"])], -1)
    T = x.shape[0]
    q = (x @ p["midlayer.self_attn.q_proj.weight"].T).view(T, nh, d)
    k = (x @ p["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, d)
    v = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, d)
    q, k = rope(q, positions, config["rope_theta"]), rope(k, positions, config["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * d)
    h = g + attn @ p["midlayer.self_attn.o_proj.weight"].T
    m = rms(h, p["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ p["midlayer.mlp.gate_proj.weight"].T) * (m @ p["midlayer.mlp.up_proj.weight"].T)) @ p["midlayer.mlp.down_proj.weight"].T
    h = h + mlp
    return rms(h, p["norm.weight"]) @ p["lm_head.weight"].T, h


@pytest.mark.parametrize("head_fixture", ["eagle3_head", "eagle3_head_specforge"])
def test_draft_logits_match_reference(qwen3_checkpoint, head_fixture, request):
    from transformers import AutoModelForCausalLM

    head_dir = request.getfixturevalue(head_fixture)
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32,
              speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 2})
    proposer = llm.engine.runner.proposer
    layers = proposer.aux_hidden_state_layers
    config = json.load(open(os.path.join(head_dir, "config.json")))
    state = load_file(os.path.join(head_dir, "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32)
    prompt = torch.tensor([[11, 42, 7, 99, 3, 250, 18, 64, 5]])
    hs = hf(prompt, output_hidden_states=True).hidden_states
    aux = [hs[i][0] for i in layers]  # inputs of the aux layers
    T = prompt.shape[1] - 1
    tokens = prompt[0, 1:]  # row t pairs features at t with token t+1
    positions = torch.arange(T)
    embed = state["embed_tokens.weight"] if "embed_tokens.weight" in state else hf.model.embed_tokens.weight.detach()
    ref_logits, ref_h = reference_head(state, config, embed, [a[:T] for a in aux], tokens, positions)

    head = proposer.head
    table = torch.arange(4, dtype=torch.int32)[None]
    bs = llm.engine.runner.cache_plan.block_size
    meta = catch_up_metadata([0], [T], table, bs, proposer.draft_block_size)
    g = head.combine([a[:T] for a in aux])
    h = head(tokens, positions, g, meta)
    torch.testing.assert_close(head.compute_logits(h), ref_logits, atol=2e-4, rtol=2e-4)
    # step(): the layer past its attention on the kept rows only; the cache is rewritten alike.
    kept = torch.tensor([T - 1, 2])
    logits, h_kept = head.step(tokens, positions, g, meta, kept)
    torch.testing.assert_close(logits, ref_logits[kept], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(h_kept, h[kept], atol=1e-5, rtol=1e-5)
    # One chained step: the previous h, the next token, the next position.
    nxt = torch.tensor([77])
    meta2 = catch_up_metadata([T], [1], table, bs, proposer.draft_block_size)
    h2 = head(nxt, torch.tensor([T]), h[-1:], meta2)
    ref_all, _ = reference_head(state, config, embed, None, torch.cat([tokens, nxt]), torch.arange(T + 1),
                                g=torch.cat([g.detach(), h[-1:].detach()]))
    torch.testing.assert_close(head.compute_logits(h2), ref_all[-1:], atol=2e-4, rtol=2e-4)
    # d2t maps draft ids to target ids.
    d2t = state["d2t"]
    assert proposer.to_target_ids(torch.tensor([0, 5])).tolist() == [0 + int(d2t[0]), 5 + int(d2t[5])]


def test_aux_layer_conventions():
    head = HFConfig({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}})
    assert resolve_aux_layers(None, head, 36) == (2, 18, 33)  # SpecForge "output of j" -> j + 1
    assert resolve_aux_layers([2, 18, 33], head, 36) == (2, 18, 33)  # the flag: inputs of layers
    assert resolve_aux_layers(None, HFConfig({}), 32) == (2, 16, 29)  # default
    with pytest.raises(ValueError, match="aux layers"):
        resolve_aux_layers([2, 18, 40], head, 36)


@pytest.mark.parametrize(
    "kwargs, spec_extra, message",
    [
        (dict(fc_input=3 * 64 + 3), {}, "fc.weight has input width"),
        (dict(draft_vocab_size=600), {}, "draft_vocab_size 600 is larger"),
        (dict(d2t_offset=400), {}, "d2t maps draft id"),
        (dict(hidden_size=32), {}, "differs from the target's embedding width"),
        (dict(hidden_size=32, layout="specforge"), {}, None),  # its own embedding: fine
        ({}, {"eagle3_aux_layer_ids": [0, 1, 9]}, "aux layers"),
        ({}, {"eagle3_aux_layer_ids": [0, 1]}, "must name 3 layers"),
    ],
)
def test_bad_eagle3_heads(qwen3_checkpoint, tmp_path, kwargs, spec_extra, message):
    folder = write_eagle3_head(str(tmp_path / "head"), qwen3_checkpoint, **kwargs)
    spec = {"method": "eagle3", "model": folder, "num_speculative_tokens": 2, **spec_extra}
    if message is None:  # a narrower head with its own embedding is fine (fc maps 3*Ht -> H)
        LLM(qwen3_checkpoint, num_kv_blocks=16, speculative_config=spec)
        return
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_checkpoint, num_kv_blocks=16, speculative_config=spec)


def test_not_an_eagle3_head(qwen3_checkpoint):
    with pytest.raises(ValueError, match="not an EAGLE3 head"):
        LLM(qwen3_checkpoint, num_kv_blocks=16,
            speculative_config={"method": "eagle3", "model": qwen3_checkpoint})
