"""On a CUDA GPU: the logits controls on the captured padded steps (runner/padded_logits_controls.py:
device state advanced by each step's own tokens, steps queued ahead) equal the host step's. The
reference is plain decoding with async scheduling off (every decode step on the host step, its
controls rebuilt from the host's lists); against it: plain decoding queued ahead (decode_ahead.py,
with logprobs), and the captured padded verify of a draft LM that accepts every draft and of an
EAGLE3 head, greedy; seeded sampling on plain decoding queued ahead."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b", "Question:"]


def greedy_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=31, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.9,
                       repetition_penalty=1.3, logit_bias={7: 2.5, 11: -100.0}, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[3, 4],
                       bad_words_token_ids=[[5], [9, 10], [20, 21, 22]]),
        SamplingParams(temperature=0, max_tokens=19, ignore_eos=True, allowed_token_ids=list(range(30, 200)),
                       repetition_penalty=1.6),
        SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, logit_bias={0: 0.0}),  # a no-op
    ]


def generate(folder, params, **kwargs):
    llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8, **kwargs)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_same(got, expected):
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        if e.logprobs is not None:
            for a, b in zip(g.logprobs, e.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("method", [None, "draft_model", "eagle3"])
def test_captured_padded_controls_equal_the_host_step(qwen3_checkpoint, eagle3_head, method):
    _, host = generate(qwen3_checkpoint, greedy_params(), async_scheduling="off")
    spec = None
    if method is not None:
        spec = {"method": method, "model": qwen3_checkpoint if method == "draft_model" else eagle3_head,
                "num_speculative_tokens": 3}
    llm, got = generate(qwen3_checkpoint, greedy_params(), speculative_config=spec)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.captures
    assert runner.pipeline.num_used > 0  # queued ahead: the device-advanced state was used
    if method is not None:
        kind = runner.pipeline.kinds[0]
        assert kind.num_controlled_steps > 0
    assert_same(got, host)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_seeded_sampling_with_controls_decoded_ahead_equals_the_host_step(qwen3_checkpoint):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True, **extra)
              for s, extra in ((1, dict(presence_penalty=1.5, logit_bias={7: 5.0})),
                               (2, dict(min_tokens=8, stop_token_ids=[3], bad_words_token_ids=[[12, 13]])),
                               (3, dict(repetition_penalty=1.8, allowed_token_ids=list(range(20, 90)))), (4, {}))]
    _, host = generate(qwen3_checkpoint, params, async_scheduling="off")
    llm, got = generate(qwen3_checkpoint, params)
    assert llm.engine.runner.pipeline.num_used > 0
    assert [g.token_ids for g in got] == [h.token_ids for h in host]
