"""MTP drafting: the engine's MTP logits equal a plain-torch reference built from the checkpoint
tensors and transformers' own DeepSeek-V3 decoder layer; greedy output with MTP equals greedy
output without it for k = 1, 2, 3 under batching, chunked prefill and preemption, for one MTP
layer (v3) and two reused in turn (kimi_k2)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from fixtures import deepseek as ds
from foretell import LLM, SamplingParams
from foretell.spec_decode.proposer import catch_up_metadata

PROMPTS = [[5, 17, 250, 3, 99, 41, 7], [300, 12, 8, 8, 61, 2, 19, 77, 140, 33, 5, 21, 90], [44], [9, 9, 9, 9]]
MAX_TOKENS = 14
STRESS = dict(max_num_batched_tokens=7, num_kv_blocks=12, block_size=4)


@pytest.fixture(scope="module")
def folders(checkpoint_root, tokenizer_dir):
    return {name: ds.checkpoint(checkpoint_root, tokenizer_dir, name) for name in ("v3", "kimi_k2")}


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(folder, spec=None, **options):
    llm = LLM(folder, dtype="float32", speculative_config=spec, **(options or dict(num_kv_blocks=64)))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def baselines(folders):
    return {name: run(folder)[0] for name, folder in folders.items()}


@pytest.mark.parametrize("mode", ["batch", "stress"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", ["v3", "kimi_k2"])
def test_greedy_mtp_equals_plain_greedy(folders, baselines, name, k, mode):
    options = dict(STRESS) if mode == "stress" else {}
    tokens, llm = run(folders[name], {"method": "mtp", "num_speculative_tokens": k}, **options)
    assert tokens == baselines[name]
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if mode == "stress":
        assert stats["num_preemptions"] > 0


def test_sampled_mtp_runs_and_frees_everything(folders):
    llm = LLM(folders["v3"], dtype="float32", num_kv_blocks=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and not llm.engine.runner.host_step.draft_probs


# ------------------------------------------------------------------------------ reference


class ReferenceMTP:
    """One MTP layer in plain torch around transformers' DeepseekV3DecoderLayer, filled from the
    checkpoint's model.layers.{index}.* tensors."""

    def __init__(self, folder: str, index: int):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding,
        )

        cfg = ds.read_config(folder)
        cfg["model_type"] = "deepseek_v3"
        config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        config._attn_implementation = "eager"
        state = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        p = f"model.layers.{index}."
        mine = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
        self.block = DeepseekV3DecoderLayer(config, index).float().eval()
        block_state = {k: v for k, v in mine.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm") and ".experts." not in k}
        e = cfg["n_routed_experts"]
        block_state["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([mine[f"mlp.experts.{i}.gate_proj.weight"], mine[f"mlp.experts.{i}.up_proj.weight"]]) for i in range(e)])
        block_state["mlp.experts.down_proj"] = torch.stack([mine[f"mlp.experts.{i}.down_proj.weight"] for i in range(e)])
        self.block.load_state_dict(block_state, strict=True)
        self.rotary = DeepseekV3RotaryEmbedding(config)
        self.w = mine
        self.eps = cfg["rms_norm_eps"]
        self.embed = state["model.embed_tokens.weight"]

    def norm(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def __call__(self, h_prev, tokens, positions):
        """Rows [T]: (hidden for t, token x_{t+1}, position t) -> (post-norm out [T, H], logits)."""
        e = self.norm(self.embed[tokens], "enorm.weight")
        h = self.norm(h_prev, "hnorm.weight")
        x = torch.cat([e, h], -1) @ self.w["eh_proj.weight"].T
        n = len(tokens)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x[None], positions[None])
        y = self.block(x[None], attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin)[0]
        out = self.norm(y, "shared_head.norm.weight")
        return out, out @ self.w["shared_head.head.weight"].T


def target_final_hidden(folder, tokens):
    import transformers

    view = ds.hf_view(folder)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(view, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0]  # after the final norm


@pytest.mark.parametrize("name", ["v3", "kimi_k2"])
def test_draft_logits_match_plain_torch_reference(folders, name):
    folder = folders[name]
    config = ds.read_config(folder)
    n = config["num_hidden_layers"]
    tokens = [5, 17, 250, 3, 99, 41, 7, 300, 12, 8]
    T = len(tokens) - 1  # rows 0..T-1 pair hidden t with token t+1; token T is "next"
    hidden = target_final_hidden(folder, tokens)
    llm = LLM(folder, dtype="float32", device="cpu", num_kv_blocks=8, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    proposer = llm.engine.runner.proposer
    assert [l.kv_cache.shape[-1] for l in proposer.kv_layers()] == [40] * config["num_nextn_predict_layers"]
    logits, state = proposer.catch_up(ds.mtp_draft_batch(tokens, hidden, 4), [0])

    layer0 = ReferenceMTP(folder, n)
    positions = torch.arange(T)
    out0, ref_logits0 = layer0(hidden[:T], torch.tensor(tokens[1:]), positions)
    torch.testing.assert_close(logits, ref_logits0[-1:], rtol=0, atol=2e-4)
    torch.testing.assert_close(state[0], out0[-1:], rtol=0, atol=2e-4)

    # chain step: draft d1 at position T, fed the previous output; the layer in turn
    d1 = torch.tensor([int(logits.argmax())])
    meta = catch_up_metadata([T], [1], torch.arange(8, dtype=torch.int32)[None], 4, proposer.draft_block_size)
    chained, _ = proposer.chain_step(d1, torch.tensor([T]), meta, state)
    all_tokens = torch.tensor(tokens[1:] + [int(d1)])
    if config["num_nextn_predict_layers"] == 1:
        _, ref = layer0(torch.cat([hidden[:T], out0[-1:]]), all_tokens, torch.arange(T + 1))
    else:  # layer 1: the row at t gets layer 0's output at t - 1 (at t for the first row)
        pred = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(T)])
        _, ref = ReferenceMTP(folder, n + 1)(out0[pred], all_tokens, torch.arange(T + 1))
    torch.testing.assert_close(chained, ref[-1:], rtol=0, atol=2e-4)


def test_mtp_needs_mtp_layers(checkpoint_root, tokenizer_dir, qwen3_checkpoint):
    v2 = ds.checkpoint(checkpoint_root, tokenizer_dir, "v2_lite")
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0 or absent"):
        LLM(v2, num_kv_blocks=8, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match=r"'mtp' drafts with DeepSeek-style MTP layers.*Qwen3ForCausalLM"):
        LLM(qwen3_checkpoint, num_kv_blocks=8, speculative_config={"method": "mtp"})
