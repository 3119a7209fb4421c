"""The default-model recipe (recipes/default_models) end to end at smoke sizes on the CPU."""

from __future__ import annotations

import pytest

import json
import os

from foretell import LLM, SamplingParams


@pytest.mark.slow  # interpreter-driven: minutes on 2 cores
def test_default_models_recipe_smoke(tmp_path):
    """recipes/default_models/train.py --smoke: every member of both families is written, loads
    in foretell, and speculation with every drafter keeps greedy output unchanged."""
    from recipes.default_models import train as recipe

    out, work = tmp_path / "models", tmp_path / "work"
    assert recipe.main(["--smoke", "--out", str(out), "--work", str(work)]) == 0
    summary = json.load(open(work / "recipe_metrics.json"))
    qwen3, deepseek = summary["measured"], summary["ds_measured"]
    for measured, methods in ((qwen3, ("eagle3", "draft_model", "ngram")), (deepseek, ("mtp_k1", "mtp", "eagle3", "ngram"))):
        for method in methods:
            assert measured[method]["greedy_equal"], method
        assert measured["teacher_forced"]["engine_walk"]["num_drafts"] <= measured["eagle3"]["num_drafts"]
    assert summary["ds_head"]["aux_layer_ids"] == [1, 2, 3]
    assert 0 <= summary["ds_target"]["eval_mtp_acceptance"] <= 1
    for name in ("qwen3-target", "qwen3-draft", "qwen3-eagle3", "deepseek-target", "deepseek-eagle3"):
        assert os.path.isfile(out / name / "README.md")
    for name in ("qwen3-eagle3", "deepseek-eagle3"):
        assert sorted(os.listdir(out / name)) == ["README.md", "config.json", "model.safetensors"]
    assert "MTP, k=1: mean acceptance length" in open(out / "deepseek-target" / "README.md").read()
    llm = LLM(str(out / "qwen3-target"), num_kv_blocks=32)
    assert llm.chat([{"role": "user", "content": "What is 2 + 3?"}], SamplingParams(max_tokens=4))[0].outputs[0].token_ids
