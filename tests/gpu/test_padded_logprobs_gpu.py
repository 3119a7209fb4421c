"""On a CUDA GPU: logprobs on the captured padded verify step (runner/logprobs.py's
padded_step_logprobs after the verify graph, read back with the step's tokens beside the stream,
steps queued ahead) equal plain decoding's host step, for requests mixing top-n values and
requests without logprobs, with a draft LM that accepts every draft (caps near max_tokens) and
an EAGLE3 head."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b", "Question:"]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=top)
          for n, top in ((31, 3), (40, None), (19, 0), (33, 20))]


def generate(folder, **kwargs):
    llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8, **kwargs)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_captured_padded_logprobs_equal_plain(qwen3_checkpoint, eagle3_head, method):
    _, plain = generate(qwen3_checkpoint)
    spec = {"method": method, "model": qwen3_checkpoint if method == "draft_model" else eagle3_head,
            "num_speculative_tokens": 3}
    llm, got = generate(qwen3_checkpoint, speculative_config=spec)
    runner = llm.engine.runner
    kind = runner.pipeline.kinds[0]
    assert runner.graphs is not None and runner.graphs.captures and kind.num_logprob_steps > 0
    assert runner.pipeline.num_used > 0  # queued ahead
    for g, e in zip(got, plain):
        assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None
            continue
        assert [lp.token_id for lp in g.logprobs] == g.token_ids
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-4)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
