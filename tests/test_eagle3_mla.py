"""EAGLE3 on an MLA target: aux hidden states from DeepSeek-V3 layers feed a standard-attention
head with its own DraftKVCache beside the target's latent cache, both from one budget; greedy
output with the head equals greedy output without it under batching, chunked prefill and
preemption."""

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
