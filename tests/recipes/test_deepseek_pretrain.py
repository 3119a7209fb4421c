"""The recipe's DeepSeek-V3-layout pretraining with one MTP layer (foretell/training/
deepseek_pretrain.py): both losses fall, the saved checkpoint is the DeepSeek-V3 layout that
transformers and foretell read, and the engine's MTP drafter computes what was trained."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fixtures import deepseek as ds
from fixtures.checkpoints import CONFIG_VOCAB_SIZE, ENDOFTEXT_ID, TOKENIZER_FILES
from foretell import LLM, SamplingParams
from recipes.default_models.deepseek_pretrain import (
    DeepseekWithMTP, deepseek_v3_config, pretrain_deepseek_mtp, save_deepseek_mtp,
)
from recipes.default_models.pretrain import PretrainOptions


def tiny_config() -> dict:
    return deepseek_v3_config(
        CONFIG_VOCAB_SIZE, hidden=64, layers=3, dense_layers=1, heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate=128, moe_intermediate=32,
        experts=8, shared_experts=1, experts_per_token=2, groups=2, topk_groups=1, max_positions=512,
        special_ids={"<|endoftext|>": ENDOFTEXT_ID})


def repeating_stream(n: int, seed: int = 0) -> torch.Tensor:
    """16 fixed random 12-token phrases, repeated in an order drawn from seed: learnable two
    tokens ahead except at phrase boundaries."""
    phrases = torch.randint(0, 200, (16, 12), generator=torch.Generator().manual_seed(1234))
    order = torch.randint(0, 16, (n // 12 + 1,), generator=torch.Generator().manual_seed(seed))
    return phrases[order].flatten()[:n]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_dir):
    opts = PretrainOptions(steps=60, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=4, progress=False, log_every=1)
    model, stats = pretrain_deepseek_mtp(tiny_config(), repeating_stream(6000), opts, repeating_stream(2000, 1))
    folder = str(tmp_path_factory.mktemp("ds_mtp"))
    save_deepseek_mtp(model, folder, max_shard_bytes=400_000)  # several shards + index
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    return model, stats, folder


def test_both_losses_fall_and_experts_get_balanced(trained):
    model, stats, _ = trained
    first, last = stats["loss_history"][0][1], stats["loss_history"][-1][1]
    assert last < first - 1.0
    assert stats["eval_mtp_loss"] < 5.0 and stats["eval_loss"] < 5.0  # log(512) = 6.2 at the start
    assert 0.0 <= stats["eval_mtp_acceptance"] <= 1.0
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.lm.model.layers[1:]]
    assert all(b.abs().max() > 0 for b in biases)  # the balancing moved every router's bias


def test_checkpoint_is_the_deepseek_v3_layout(trained):
    model, _, folder = trained
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    keys = set(index["weight_map"])
    n = 3
    assert f"model.layers.{n}.eh_proj.weight" in keys and f"model.layers.{n}.shared_head.head.weight" in keys
    assert f"model.layers.{n}.embed_tokens.weight" in keys and f"model.layers.{n}.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in keys)
    assert len(set(index["weight_map"].values())) > 1
    # transformers reads it back (the MTP layer's keys are extra) with the same logits
    import transformers

    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = DeepseekWithMTP(model.config)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    ids = repeating_stream(30, 5)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, reference.lm(ids).logits, atol=1e-4, rtol=1e-4)


def test_engine_mtp_drafter_computes_the_trained_layer(trained):
    model, _, folder = trained
    reference = DeepseekWithMTP(model.config).eval()
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    tokens = repeating_stream(11, 7).tolist()
    T = len(tokens) - 1
    with torch.no_grad():
        logits = reference(torch.tensor([tokens + [0]]))  # rows 0..T-1 pair h_t with x_{t+1}
        hidden = reference.lm.model(torch.tensor([tokens])).last_hidden_state[0]
    llm = LLM(folder, dtype="float32", device="cpu", num_kv_blocks=8, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    proposer = llm.engine.runner.proposer
    drafted, _ = proposer.catch_up(ds.mtp_draft_batch(tokens, hidden, 4), [0])  # [1, V]: the last row
    torch.testing.assert_close(drafted, logits["mtp"][0, T - 1 : T], atol=2e-4, rtol=0)


def test_greedy_with_the_trained_mtp_equals_plain_greedy(trained):
    _, _, folder = trained
    prompts = [{"prompt_token_ids": repeating_stream(20, s).tolist()} for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(folder, dtype="float32", num_kv_blocks=32, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_stats()["acceptance_rate"] > 0.2  # a trained layer on a learnable stream
