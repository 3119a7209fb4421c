"""On a CUDA GPU: a hybrid drafter (suffix + a model drafter) verifies on the target's captured graphs
(runner/host_drafts.py: the padded step over HostDraftSlots with reads_rows), its model drafter
catching up on the host over each replay's rows after the read (DrafterRows); greedy output (fp32)
equals plain decoding's with logprobs, no verify takes the host step, nothing is queued ahead, and
no block is kept. The CPU twin (eager buffers): tests/runner/test_hybrid_padded_step.py."""

from __future__ import annotations

import pytest

from fixtures.padded_step import assert_same_outputs, record_host_steps
from foretell import LLM, SamplingParams
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_drafts import HostDraftSlots

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "def add(x):\n    return x + 1\ndef add(x):",
           "a b a b a b a b", "Question: what is 3 plus 7? Answer:"]


def engine(folder, spec=None) -> LLM:
    return LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8, speculative_config=spec)


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_hybrid_verifies_on_the_graphs(qwen3_checkpoint, eagle3_head, method, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2) for _ in PROMPTS]
    plain = [o.outputs[0] for o in engine(qwen3_checkpoint).generate(PROMPTS, params, use_tqdm=False)]
    model = eagle3_head if method == "eagle3" else qwen3_checkpoint  # (the target drafting for itself)
    llm = engine(qwen3_checkpoint, {"method": "suffix", "hybrid": method, "model": model,
                                    "num_speculative_tokens": 8, "hybrid_num_speculative_tokens": 2,
                                    "suffix_decoding_min_accepted_tokens": 1.0})
    host_steps = record_host_steps(monkeypatch)  # from here: the warm-up mixed prefills with verifies
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = llm.engine.runner
    assert runner.graphs.captures and isinstance(runner.draft_graphs, HostDraftSlots)
    assert runner.draft_graphs.reads_rows and not runner.pipeline.queue_ahead
    assert all(host_steps)  # the host step took batches with prefill rows alone
    verify = next(kind for kind in runner.pipeline.kinds if isinstance(kind, GraphedVerify))
    assert verify.num_steps > 0 and runner.proposer.num_model_drafts > 0
    assert_same_outputs(got, plain)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if method == "draft_model":
        assert stats["num_accepted_tokens"] > 0
