"""EAGLE3 on an MLA target: aux hidden states from DeepSeek-V3 layers feed a standard-attention
head with its own DraftKVCache beside the target's latent cache, both from one budget; greedy
output with the head equals greedy output without it under batching, chunked prefill and
preemption. Also heads whose draft layer is itself MLA (config with kv_lora_rank): same
losslessness, a latent draft cache, and logits equal to a reference built on transformers'
DeepseekV3Attention."""

from __future__ import annotations

import os

import pytest
import torch

from fixtures import deepseek as ds
from foretell import LLM, SamplingParams

PROMPTS = [[5, 17, 250, 3, 99, 41, 7], [300, 12, 8, 8, 61, 2, 19, 77, 140, 33, 5, 21, 90], [44], [9, 9, 9, 9]]
MAX_TOKENS = 14
STRESS = dict(max_num_batched_tokens=7, num_kv_blocks=12, block_size=4)


@pytest.fixture(scope="module")
def target(checkpoint_root, tokenizer_dir):
    return ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")


@pytest.fixture(scope="module")
def head(checkpoint_root, target):
    folder = os.path.join(checkpoint_root, "deepseek_v3_eagle3_head")
    if not os.path.isdir(folder):
        # SpecForge-style ids [0, 1, 2] ("output of layer j") = inputs of layers 1, 2, 3
        ds.write_eagle3_head(folder, ds.read_config(target), aux_ids=[0, 1, 2])
    return folder


def generate(folder, spec=None, **options):
    llm = LLM(folder, dtype="float32", speculative_config=spec, **(options or dict(num_kv_blocks=64)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def baseline(target):
    return generate(target)[0]


@pytest.mark.parametrize("mode", ["batch", "stress"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_eagle3_on_mla_equals_plain_greedy(target, head, baseline, k, mode):
    options = dict(STRESS) if mode == "stress" else {}
    tokens, llm = generate(target, {"method": "eagle3", "model": head, "num_speculative_tokens": k}, **options)
    assert tokens == baseline
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if mode == "stress":
        assert stats["num_preemptions"] > 0


def test_caches_share_one_budget(target, head):
    budget = 1 << 20
    llm = LLM(target, dtype="float32", kv_cache_memory_bytes=budget, block_size=4,
              speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2})
    runner = llm.engine.runner
    plan = runner.cache_plan
    assert runner.proposer.aux_hidden_state_layers == (1, 2, 3)
    # target: 4 MLA layers x (kv_lora_rank 32 + rope 8) floats; head: 1 GQA layer, 2 x 2 heads x 16
    assert plan.target_bytes_per_token == 4 * 40 * 4
    assert plan.draft_bytes_per_token == 2 * 2 * 16 * 4
    assert [t.shape[1:] for t in runner.kv_cache.tensors] == [(4, 40)] * 4
    assert plan.total_bytes <= budget and plan.num_tokens == budget // (160 * 4 + 64 * 4) // 4 * 4
    assert runner.draft_kv_cache.nbytes == plan.num_tokens * plan.draft_bytes_per_token
    assert runner.kv_cache.nbytes == plan.num_tokens * plan.target_bytes_per_token


# ---------------------------------------------------------------- heads whose draft layer is MLA


@pytest.fixture(scope="module")
def mla_heads(checkpoint_root, target):
    heads = {}
    for name, q_lora in (("q_lora", 48), ("q_proj", None)):
        folder = os.path.join(checkpoint_root, f"deepseek_v3_eagle3_mla_head_{name}")
        if not os.path.isdir(folder):
            ds.write_eagle3_mla_head(folder, ds.read_config(target), aux_ids=[0, 1, 2], q_lora_rank=q_lora)
        heads[name] = folder
    return heads


@pytest.mark.parametrize("head_kind,k,mode", [("q_lora", 1, "batch"), ("q_lora", 3, "stress"),
                                              ("q_proj", 2, "batch"), ("q_proj", 2, "stress")])
def test_greedy_mla_head_equals_plain_greedy(target, mla_heads, baseline, head_kind, k, mode):
    from foretell.models.eagle3_mla import Eagle3MLAHead

    options = dict(STRESS) if mode == "stress" else {}
    spec = {"method": "eagle3", "model": mla_heads[head_kind], "num_speculative_tokens": k}
    tokens, llm = generate(target, spec, **options)
    assert tokens == baseline
    runner = llm.engine.runner
    assert isinstance(runner.proposer.head, Eagle3MLAHead)
    assert [t.shape[2:] for t in runner.draft_kv_cache.tensors] == [(40,)]  # a latent draft cache
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if mode == "stress":
        assert stats["num_preemptions"] > 0


def reference_mla_head(folder, embed_weight, aux, tokens, positions):
    """The head's step in plain torch around transformers' DeepseekV3Attention (built 2H wide)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = ds.read_config(folder)
    s = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    h = cfg["hidden_size"]
    wide = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")} | {"hidden_size": 2 * h})
    wide._attn_implementation = "eager"
    attn = DeepseekV3Attention(wide, 0).float().eval()
    attn.o_proj = torch.nn.Linear(cfg["num_attention_heads"] * cfg["v_head_dim"], h, bias=False)
    p = "midlayer.self_attn."
    attn.load_state_dict({k[len(p):]: v for k, v in s.items() if k.startswith(p)}, strict=True)
    rotary = DeepseekV3RotaryEmbedding(wide)

    def norm(x, name):
        return s[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    def mlp(x):
        gate, up, down = (s[f"midlayer.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    with torch.no_grad():
        g = torch.cat(aux, -1) @ s["fc.weight"].T
        embed = embed_weight[tokens]  # no embed_tokens in the head: the target's
        x = torch.cat([norm(embed, "midlayer.input_layernorm.weight"), norm(g, "midlayer.hidden_norm.weight")], -1)
        n = len(tokens)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a, _ = attn(x[None], rotary(x[None], positions[None]), mask)
        h1 = g + a[0]
        h2 = h1 + mlp(norm(h1, "midlayer.post_attention_layernorm.weight"))
        return norm(h2, "norm.weight") @ s["lm_head.weight"].T


def test_mla_head_logits_match_reference(target, mla_heads):
    import transformers
    from foretell.spec_decode.proposer import catch_up_metadata

    folder = mla_heads["q_lora"]
    llm = LLM(target, dtype="float32", device="cpu", num_kv_blocks=16, block_size=4,
              speculative_config={"method": "eagle3", "model": folder, "num_speculative_tokens": 2})
    proposer = llm.engine.runner.proposer
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager")
    prompt = torch.tensor([[11, 42, 7, 99, 3, 250, 18, 64, 5]])
    with torch.no_grad():
        hs = hf(prompt, output_hidden_states=True).hidden_states
    T = prompt.shape[1] - 1
    aux = [hs[i][0][:T] for i in proposer.aux_hidden_state_layers]
    tokens, positions = prompt[0, 1:], torch.arange(T)
    meta = catch_up_metadata([0], [T], torch.arange(4, dtype=torch.int32)[None], 4, proposer.draft_block_size)
    with torch.no_grad():
        h = proposer.head(tokens, positions, proposer.head.combine(aux), meta)
        logits = proposer.head.compute_logits(h)
    torch.testing.assert_close(logits, reference_mla_head(folder, hf.model.embed_tokens.weight.detach(), aux, tokens, positions), rtol=0, atol=2e-4)
