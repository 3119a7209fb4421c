"""The shipped default family (foretell/default_models) loads and generates, and greedy output
with each shipped drafter equals the target's own greedy output."""

from __future__ import annotations

import os

import pytest

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
