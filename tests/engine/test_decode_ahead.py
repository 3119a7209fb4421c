"""Decoding one step ahead (async_scheduling): the same tokens as without it (greedy and seeded
sampling), while sequences finish at different steps, cross block boundaries, arrive mid-way, get
preempted or aborted; launched steps are used when the batch continues; no KV block leaks."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams
from foretell.engine.engine import Engine

PROMPTS = [
    "The cat reads the book. The dog",
    "def add(x):\n    return",
    "Question: what is 3 plus 7? Answer:",
    "a",
]


def make(folder, mode: str, **options) -> LLM:
    options.setdefault("num_kv_blocks", 128)
    return LLM(folder, dtype="float32", async_scheduling=mode, **options)


def tokens(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_requests_running"] == 0


# Different lengths, so the batch shrinks as sequences finish (a launched step then goes unused).
MIXED = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 17, 9, 23)]


@pytest.mark.parametrize(
    "options",
    [dict(), dict(block_size=4), dict(num_kv_blocks=12, block_size=4), dict(max_num_seqs=1)],
    ids=["blocks16", "blocks4", "preempt", "serial"],
)
def test_greedy_tokens_equal_without_decode_ahead(qwen3_checkpoint, options):
    expected = tokens(make(qwen3_checkpoint, "off", **options), MIXED)
    llm = make(qwen3_checkpoint, "on", **options)
    assert tokens(llm, MIXED) == expected
    runner = llm.engine.runner
    assert runner.pipeline.queue_ahead and runner.pipeline.num_used > 0
    assert runner.pipeline.num_used <= runner.pipeline.num_launched
    if options.get("num_kv_blocks") == 12:
        assert llm.get_stats()["num_preemptions"] > 0
    assert_all_free(llm)


def test_a_lone_sequence_uses_nearly_every_launch(qwen3_checkpoint):
    llm = make(qwen3_checkpoint, "on", block_size=4)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.runner
    # 29 decode steps; block boundaries (every 4th position) cannot launch ahead, and no launch is
    # made past max_tokens, so every launch is used.
    assert runner.pipeline.num_launched == runner.pipeline.num_used >= 20
    assert runner.pipeline.queued is None


def test_seeded_sampling_equal_without_decode_ahead(qwen3_checkpoint):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=12 + 3 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    assert tokens(make(qwen3_checkpoint, "on"), params) == tokens(make(qwen3_checkpoint, "off"), params)


def test_stops_and_logprob_requests_mixed_in(qwen3_checkpoint):
    """An EOS-like stop ends a sequence at an unknown step (its launched step is dropped); a
    request with logprobs is decoded ahead too (its logprobs read back with the tokens)."""
    probe = tokens(make(qwen3_checkpoint, "off"), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[probe[0][5]]),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    plain = make(qwen3_checkpoint, "off").generate(PROMPTS, params, use_tqdm=False)
    llm = make(qwen3_checkpoint, "on")
    ahead = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ahead, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert ahead[0].outputs[0].finish_reason == "stop"
    assert [lp.token_id for lp in ahead[1].outputs[0].logprobs] == ahead[1].outputs[0].token_ids
    assert llm.engine.runner.pipeline.num_used > 0
    assert_all_free(llm)


def test_arrivals_and_aborts_between_steps(qwen3_checkpoint):
    """Requests added and aborted while a step is launched ahead: the batch changes, the launch
    is dropped, and the survivors' tokens are those of an engine without decode-ahead."""

    def run(mode: str) -> tuple[dict[str, list[int]], Engine]:
        engine = make(qwen3_checkpoint, mode, block_size=4).engine
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        engine.add_request("a", PROMPTS[0], params)
        done: dict[str, list[int]] = {}
        step = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            step += 1
            if step == 3:
                engine.add_request("b", PROMPTS[1], params)
                engine.add_request("c", PROMPTS[2], params)
            if step == 7:
                engine.abort_request("c")
        return done, engine

    expected, _ = run("off")
    got, engine = run("on")
    assert got == expected and set(got) == {"a", "b"}
    assert engine.runner.pipeline.num_used > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_off_by_default_on_cpu(qwen3_checkpoint, eagle3_head):
    assert not make(qwen3_checkpoint, "auto").engine.runner.pipeline.queue_ahead
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2}
    assert not make(qwen3_checkpoint, "auto", speculative_config=spec).engine.runner.pipeline.queue_ahead


@pytest.mark.parametrize("drafter", ["eagle3", "draft_model"])
def test_verify_steps_queue_ahead_on_the_eager_padded_step(qwen3_checkpoint, eagle3_head, drafter):
    """Without graphs (the CPU's torch backend) greedy verifies take the padded step run eagerly,
    which leaves the next step's inputs on the device: with async scheduling on, it is queued
    ahead as on a GPU, and the tokens stay the plain engine's."""
    spec = {"method": drafter, "model": eagle3_head if drafter == "eagle3" else qwen3_checkpoint,
            "num_speculative_tokens": 2}
    want = tokens(make(qwen3_checkpoint, "off"), MIXED)
    llm = make(qwen3_checkpoint, "on", speculative_config=spec)
    assert tokens(llm, MIXED) == want
    pipeline = llm.engine.runner.pipeline
    assert pipeline.queue_ahead and pipeline.num_used > 0
    assert_all_free(llm)


def test_bad_mode_is_refused(qwen3_checkpoint):
    with pytest.raises(ValueError, match="async_scheduling must be auto, on or off"):
        make(qwen3_checkpoint, "sometimes")
