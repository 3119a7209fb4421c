"""The shipped default family (foretell/default_models) loads and generates, and greedy output
with each shipped drafter equals the target's own greedy output."""

from __future__ import annotations

import os

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.defaults import member_path

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def read_file(path):",
    "Question: A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts?",
]

pytestmark = pytest.mark.skipif(not os.path.isdir(member_path("target")), reason="no default models")


def generate(**kwargs):
    llm = LLM(member_path("target"), num_kv_blocks=128, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


def test_default_family_is_lossless_with_every_drafter():
    _, plain, texts = generate()
    assert all(texts) and "clips" in texts[0] + PROMPTS[0]
    for method in ("eagle3", "draft_model", "ngram"):
        spec = {"method": method, "num_speculative_tokens": 3}
        if method != "ngram":
            spec["model"] = member_path(method)
        llm, got, _ = generate(speculative_config=spec)
        assert got == plain, method
        if method == "eagle3":  # a trained head: it accepts a real share of its drafts
            assert llm.get_stats()["acceptance_rate"] > 0.05  # a random head: 0


@pytest.mark.skipif(not os.path.isdir(member_path("target", "deepseek")), reason="no DeepSeek default model")
def test_deepseek_family_is_lossless_with_every_drafter():
    """The DeepSeek-V3-layout member: MLA + MoE target, its own MTP layer, its EAGLE3 head (EAGLE3
    on an MLA target), the shared-tokenizer draft model and n-gram."""

    def run(spec):
        llm = LLM(member_path("target", "deepseek"), num_kv_blocks=128, speculative_config=spec)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]

    _, plain = run(None)
    assert all(plain)
    for method, model in (("mtp", None), ("eagle3", member_path("eagle3", "deepseek")),
                          ("draft_model", member_path("draft_model", "deepseek")), ("ngram", None)):
        spec = {"method": method, "num_speculative_tokens": 3}
        if model:
            spec["model"] = model
        llm, got = run(spec)
        assert got == plain, method
        if method in ("mtp", "eagle3"):  # trained drafters accept a real share of their drafts
            assert llm.get_stats()["acceptance_rate"] > 0.05, method


def test_prefix_cache_hit_leaves_the_draft_cache_as_a_cold_start_would():
    """EAGLE3's KV at a block's last slot depends on the token after it, so a prefix-cache hit
    stops one block short: for a prompt that shares a cached prefix up to a block boundary and
    then differs, every draft KV entry equals a fresh engine's."""
    spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}

    def engine():
        return LLM(member_path("target"), dtype="float32", num_kv_blocks=64, block_size=4,
                   speculative_config=spec)

    def draft_keys_after_prefill(llm, prompt):
        eng = llm.engine
        eng.add_request("probe", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4))
        eng.step()  # the whole prompt in one prefill
        seq = eng.requests["probe"].seqs[0]
        cache = eng.runner.draft_kv_cache.tensors[0]  # [2, blocks, block_size, heads, head_dim]
        size = cache.shape[2]
        keys = torch.stack([cache[0, seq.block_ids[p // size], p % size] for p in range(len(prompt))])
        eng.abort_request("probe")
        return keys

    warm = engine()
    shared = warm.tokenizer.encode(PROMPTS[0])[:20]  # five full blocks
    first = warm.tokenizer.encode(" In May she sold 24 clips.")
    second = warm.tokenizer.encode(" So she sold 72 clips in all.")
    assert first[0] != second[0]
    draft_keys_after_prefill(warm, shared + first)
    hit = draft_keys_after_prefill(warm, shared + second)
    assert warm.get_stats()["prefix_cache_hit_rate"] > 0.2  # four of the five shared blocks
    cold = draft_keys_after_prefill(engine(), shared + second)
    torch.testing.assert_close(hit, cold, atol=1e-5, rtol=1e-5)
