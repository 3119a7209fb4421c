"""foretell.bench.bench_models (the model folders benchmark scripts run on) and the engine probes
scripts/check_trees_gpu.py, tree_step_phases.py and check_structured_gpu.py read through
foretell.bench.engine_probe instead of runner attributes: vocabulary and device, grammar-mask
timer and forced drafts, the tree step's graph use and its uncaptured graphs; on the CPU with the tiny models."""

from __future__ import annotations

import json
import os

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.bench import engine_probe as probe
from foretell.bench.bench_models import (BenchModels, eagle3_bench_models, published_config_folder,
                                         synthetic_prompt)
from foretell.bench.tiny_checkpoints import QWEN3_TINY
from foretell.structured.draft_mask import MaskTimer

TREE = {"num_speculative_tokens": 2, "topk": 2, "num_draft_tokens": 4}
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> BenchModels:
    return eagle3_bench_models(tiny=True, folder=str(tmp_path_factory.mktemp("bench_models")))


def engine(models: BenchModels, spec: dict | None = None) -> LLM:
    if spec is not None:
        spec = {"method": "eagle3", "model": models.head, **spec}
    return LLM(models.target, speculative_config=spec, skip_tokenizer_init=True, max_num_seqs=2, num_kv_blocks=64,
               log_stats_interval_s=0, **models.engine_options)


def test_tiny_models_are_a_target_and_its_head_on_the_cpu(tiny, tmp_path):
    assert tiny.engine_options == {"dtype": "float32", "device": "cpu"}
    assert os.path.dirname(tiny.target) == os.path.dirname(tiny.head)
    with open(os.path.join(tiny.head, "config.json")) as f:
        head = json.load(f)
    assert head["draft_vocab_size"] == 256 and head["target_hidden_size"] == QWEN3_TINY["hidden_size"]
    target, head_folder, options = eagle3_bench_models(tiny=True, folder=str(tmp_path))  # unpacks as a tuple
    assert target.startswith(str(tmp_path)) and head_folder.startswith(str(tmp_path)) and options["device"] == "cpu"


def test_published_shapes_are_llama_8b_and_its_eagle3_head_as_dummy_weights():
    models = eagle3_bench_models(tiny=False)  # writes nothing, loads nothing
    assert models.engine_options == {"dtype": "bfloat16", "device": "cuda", "load_format": "dummy"}
    with open(os.path.join(models.target, "config.json")) as f:
        target = json.load(f)
    assert (target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]) == (4096, 32, 128256)
    assert os.path.basename(models.head) == "llama-3.1-8b-eagle3"
    assert published_config_folder("deepseek-v2-lite").endswith(os.path.join("configs", "deepseek-v2-lite"))


def test_published_config_folder_names_what_exists():
    with pytest.raises(ValueError, match=r"no published config 'llama-9b'.*llama-3.1-8b"):
        published_config_folder("llama-9b")


def test_synthetic_prompt_is_the_fixed_pattern_inside_the_vocabulary():
    assert synthetic_prompt(512, 5) == {"prompt_token_ids": [1, 8, 15, 22, 29]}
    ids = synthetic_prompt(512, 200)["prompt_token_ids"]
    assert min(ids) >= 1 and max(ids) <= 511 and ids[73] == (7 * 73) % 511 + 1
    assert max(synthetic_prompt(128256, 400)["prompt_token_ids"]) <= 1000  # the pattern stays below 1000
    assert synthetic_prompt(2, 3) == {"prompt_token_ids": [1, 1, 1]}
    with pytest.raises(ValueError, match="vocab_size >= 2 and length >= 1, got 1 and 4"):
        synthetic_prompt(1, 4)
    with pytest.raises(ValueError, match="got 512 and 0"):
        synthetic_prompt(512, 0)


def test_vocab_device_and_grammar_probes(tiny):
    with engine(tiny, {"num_speculative_tokens": 2}) as llm:
        assert probe.vocab_size(llm) == QWEN3_TINY["vocab_size"]
        assert probe.engine_device(llm) == torch.device("cpu")
        timer = probe.grammar_mask_timer(llm)
        assert isinstance(timer, MaskTimer)
        llm.generate([synthetic_prompt(512, 12)], PARAMS, use_tqdm=False)
        assert timer.verify_fill_seconds == 0.0 and timer.forced_drafts == 0  # no grammar request: no masks
        structured = llm.engine.runner.host_step.structured
        assert structured.forced_drafts is True  # speculative_config structured_forced_drafts' default
        with probe.grammar_forced_drafts(llm, False):
            assert structured.forced_drafts is False
            with probe.grammar_forced_drafts(llm, True):
                assert structured.forced_drafts is True
            assert structured.forced_drafts is False
        assert structured.forced_drafts is True
        with pytest.raises(RuntimeError), probe.grammar_forced_drafts(llm, False):
            raise RuntimeError("the setting comes back after an error too")
        assert structured.forced_drafts is True
        with pytest.raises(ValueError, match="topk > 1"):
            probe.tree_graph_use(llm)
        with pytest.raises(ValueError, match="use_uncaptured_tree_graphs needs an engine that drafts trees"):
            probe.use_uncaptured_tree_graphs(llm)


def test_grammar_mask_timer_counts_a_grammar_request(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64, log_stats_interval_s=0) as llm:
        timer = probe.grammar_mask_timer(llm)
        before = timer.seconds
        out = llm.generate(["Pick one:"], SamplingParams(temperature=0, max_tokens=6,
                                                         structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)
        assert out[0].outputs[0].text in ("yes", "no")
        assert timer.seconds > before  # the same live counters the engine writes


def test_tree_graph_use_counts_verifies_on_the_tree_graphs(tiny):
    with engine(tiny, TREE) as llm:
        prompt = synthetic_prompt(probe.vocab_size(llm), 20)
        plain_use = probe.tree_graph_use(llm)
        assert plain_use == dict.fromkeys(plain_use, 0)  # eager on the CPU: no graphs
        eager = llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert probe.tree_graph_use(llm)["graphed_verifies"] == 0
        probe.use_uncaptured_tree_graphs(llm)  # every tree step from now on runs the graphs' code path
        assert llm.engine.runner.tree_step.verify_graphs is not None
        steps = llm.get_stats()["num_steps"]
        graphed = llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        use = probe.tree_graph_use(llm)
        assert graphed == eager
        verifies = llm.get_stats()["num_steps"] - steps - 1  # every step but the prompt's prefill
        assert verifies > 0 and use["graphed_verifies"] == verifies
        assert use["graphed_drafts"] == verifies + 1  # a tree drafted after the prefill and every verify
        assert use["graphed_catch_ups"] == verifies  # each graphed verify's catch-up ran with the expansion
        assert use["verify_graphs_captured"] == 0  # uncaptured: nothing was recorded as a graph
        assert all(isinstance(v, int) and v >= 0 for v in use.values())
