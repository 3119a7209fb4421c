"""On a CUDA GPU: batches of prompt chunks beside verifies split (runner/split_step.py): one eager
forward over both, the verifies' outputs loaded into the captured graphs' buffers and finished
there (verification, the draft loop's graphs), the prompt chunks' rows on the host step;
greedy output (fp32, with logprobs) equals plain decoding's, no host step verifies a draft, steps are
still queued ahead between split batches, and no block is kept. The CPU twin (eager buffers):
tests/runner/test_split_step.py."""

from __future__ import annotations

import pytest

from fixtures.padded_step import assert_same_outputs, count_steps, short_context_copy
from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "def add(x):\n    return x + 1\ndef add(x):",
           "a b a b a b a b", "Question: what is 3 plus 7? Answer:", "One two three four five six seven"]
ARRIVALS = dict(max_num_seqs=2, max_num_batched_tokens=8)  # chunked prompts arriving beside verifies


def engine(folder, spec=None) -> LLM:
    return LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, speculative_config=spec, **ARRIVALS)


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_split_batches_verify_on_the_graphs(qwen3_checkpoint, eagle3_head, method, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * i, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    plain = [o.outputs[0] for o in engine(qwen3_checkpoint).generate(PROMPTS, params, use_tqdm=False)]
    model = eagle3_head if method == "eagle3" else qwen3_checkpoint  # (the target drafting for itself)
    llm = engine(qwen3_checkpoint, {"method": method, "model": model, "num_speculative_tokens": 3})
    counts = count_steps(monkeypatch)
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = llm.engine.runner
    assert runner.graphs.captures and runner.draft_graphs.captures
    assert runner.num_split_steps > 0 and counts["padded"] > 0 and counts["host_verify"] == 0, counts
    assert runner.pipeline.queue_ahead and runner.pipeline.num_used > 0
    assert_same_outputs(got, plain)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if method == "draft_model":
        assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0  # (GEMMs of other row counts)


def test_verifies_at_the_end_of_the_rotary_table_on_the_graphs(qwen3_checkpoint, eagle3_head, tmp_path, monkeypatch):
    """A target whose rotary table ends at max_model_len (40): verifies running into it replay the
    graphs with their padded rows past the limit rotated at its last position (and the draft loop's
    rows clamped); greedy fp32 = plain, every sequence ends at the limit, no verify on the host step."""
    folder = short_context_copy(qwen3_checkpoint, tmp_path, 40)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    plain = [o.outputs[0] for o in engine(folder).generate(PROMPTS, params, use_tqdm=False)]
    llm = engine(folder, {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3})
    counts = count_steps(monkeypatch)
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert llm.engine.runner.graphs.captures and llm.engine.runner.max_model_len == 40
    assert counts["padded"] > 0 and counts["host_verify"] == 0, counts
    assert_same_outputs(got, plain)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
