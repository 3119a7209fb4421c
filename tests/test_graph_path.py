"""The CUDA-graph path (static buffers, padded buckets, device-side verification, the draft-loop
graph) run without capture on the CPU through Triton's interpreter: greedy output equals the
plain engine's, with real and with simulated acceptance. On a GPU the same code is captured."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat", "a b a b a b a b", "Question: what"]


if torch.cuda.is_available():
    pytest.skip("on a GPU the graph path is tested captured (tests/gpu)", allow_module_level=True)


from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.layers.attention.triton_kernels")
import_interpreted("foretell.layers.attention.triton_backend")


def generate(folder, **kwargs):
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_graph_path_matches_plain_greedy(qwen3_checkpoint, qwen3_tied_checkpoint, eagle3_head, monkeypatch):
    from foretell.runner import model_runner

    calls = []
    original = model_runner.graphed_greedy_verify
    monkeypatch.setattr(model_runner, "graphed_greedy_verify", lambda *a: calls.append(1) or original(*a))
    _, plain = generate(qwen3_checkpoint)
    configs = [
        # A self-draft is accepted every time; another LM and a random EAGLE3 head are rejected
        # at various positions: both catch-up layouts (row offset 0 and -1) with partial accepts.
        {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 2},
        {"method": "draft_model", "model": qwen3_tied_checkpoint, "num_speculative_tokens": 3},
        {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2},
    ]
    for config in configs:
        before = len(calls)
        llm, got = generate(qwen3_checkpoint, attention_backend="triton", speculative_config=config)
        assert got == plain, config
        assert llm.engine.runner.draft_graphs is not None and len(calls) > before, config
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_graph_path_with_simulated_acceptance(qwen3_checkpoint, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2,
            "simulate_acceptance": {"rates": [0.8, 0.5]}}
    llm, got = generate(qwen3_checkpoint, attention_backend="triton", speculative_config=spec)
    stats = llm.get_stats()
    assert stats["synthetic_acceptance"] and stats["num_accepted_tokens"] > 0
    assert all(len(tokens) == 12 for tokens in got)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
