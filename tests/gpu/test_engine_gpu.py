"""On a CUDA GPU: CUDA-graph replay equals eager execution, and greedy speculation equals plain
greedy in float32 with the Triton backend, for every drafter."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b", "Question:"]


def run(folder, **kwargs):
    llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_graph_replay_equals_eager(qwen3_checkpoint):
    eager_llm, eager = run(qwen3_checkpoint, enforce_eager=True)
    assert eager_llm.engine.runner.graphs is None
    graph_llm, graphed = run(qwen3_checkpoint)
    assert graph_llm.engine.runner.graphs is not None and graph_llm.engine.runner.graphs.graphs
    assert graphed == eager


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_fp32_greedy_speculation_equals_plain(qwen3_checkpoint, eagle3_head, method):
    _, plain = run(qwen3_checkpoint)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = qwen3_checkpoint
    if method == "eagle3":
        spec["model"] = eagle3_head
    llm, speculative = run(qwen3_checkpoint, speculative_config=spec)
    assert speculative == plain
    if method != "ngram":  # graphed drafters: verify steps are queued ahead (async_scheduling auto)
        assert llm.engine.runner.draft_graphs is not None and llm.engine.runner.pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_ahead_gives_the_same_tokens(qwen3_checkpoint, dtype):
    """async_scheduling (auto: on for CUDA) queues the next graphed decode step before reading
    this one's tokens; the launched steps replay the same graphs on the same inputs, so the tokens
    equal those of a synchronous engine bit for bit, in bf16 too."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 40, 19, 33)]
    params[2] = SamplingParams(temperature=0.8, seed=5, max_tokens=19, ignore_eos=True)
    outs = {}
    for mode in ("off", "auto"):
        llm = LLM(qwen3_checkpoint, device="cuda", dtype=dtype, num_kv_blocks=256, max_num_seqs=8,
                  block_size=8, async_scheduling=mode)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    runner = llm.engine.runner
    assert runner.pipeline.queue_ahead and runner.graphs is not None and runner.pipeline.num_used > 0
    assert outs["auto"] == outs["off"]
