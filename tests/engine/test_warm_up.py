"""The start-up warm-up (engine/warm_up.py): dummy requests of every tile-covering length run
through the engine, then leave no trace: counters at zero, every KV block free, no cached prefix,
and the engine's outputs equal those of an engine that did not warm up."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The dog", "a", "Question: what is 3 plus 7? Answer:"]


def outputs(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("spec", [None, "draft_model", "adaptive"])
def test_warm_up_leaves_no_trace(qwen3_checkpoint, spec):
    config = None if spec is None else {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 2}
    if spec == "adaptive":  # its step costs are learned from real steps: the warm-up's must not count
        config["num_speculative_tokens"] = "auto"
    cold = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, warm_up="off", speculative_config=config)
    warm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, warm_up="on", max_num_batched_tokens=64,
               speculative_config=config)
    assert cold.engine.warm_up_seconds == 0.0 and warm.engine.warm_up_seconds > 0.0
    stats = warm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_requests_running"] == 0
    assert stats["prompt_tokens_total"] == stats["generation_tokens_total"] == 0
    assert stats["prefix_cache_hit_rate"] == 0.0 and not warm.engine.block_manager.cached
    if spec is not None:
        assert stats["num_drafts"] == 0
    if spec == "adaptive":
        assert stats["adaptive_timed_steps"] == 0
    assert outputs(warm) == outputs(cold)


def test_adaptive_warm_up_runs_every_draft_count(qwen3_checkpoint, monkeypatch):
    """Under adaptive speculation the warm-up drafts every k in 0..K, each a few steps in a row, so
    their step kinds compile before the first request; the policy starts after it."""
    from foretell.engine import warm_up as warm_up_module

    made = []

    class Recording(warm_up_module.EveryDraftCount):
        def __init__(self, max_k):
            super().__init__(max_k)
            made.append(self)

    monkeypatch.setattr(warm_up_module, "EveryDraftCount", Recording)
    config = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": "auto"}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, warm_up="on", max_num_batched_tokens=64,
              speculative_config=config)
    (policy,) = made
    assert set(policy.chosen) == set(range(policy.max_k + 1))
    assert [0, 0, 0, 1, 1, 1] == policy.chosen[:6]
    assert llm.engine.scheduler.draft_length is llm.engine.adaptive  # the real policy after the warm-up


def test_warm_up_prefills_every_short_tail_over_a_cached_prefix(qwen3_checkpoint, monkeypatch):
    """After a base prompt of whole blocks, the base plus 1..16 tokens: each one's prefill is just
    its tail over the cached base (the one-launch attention's query blocks with a split context,
    which the short cached prompts do not reach); nothing of it is left afterwards."""
    from foretell.engine.warm_up import MAX_TAIL, cached_tail_prompts
    from foretell.runner.model_runner import ModelRunner

    prefills = {}  # request id -> (tokens cached before its first step, tokens that step computes)
    execute = ModelRunner.execute

    def recording(runner, sched):
        for item in sched.scheduled:
            seq = item.seq
            if seq.request_id.startswith("warm-up-tail-") and seq.request_id not in prefills:
                prefills[seq.request_id] = (seq.num_computed_tokens, item.num_new_tokens)
        return execute(runner, sched)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=256, warm_up="on", max_num_batched_tokens=512)
    block_size = llm.engine.facts.cache_plan.block_size
    base_len = len(cached_tail_prompts(llm.engine.max_model_len - 16, block_size, 100)["warm-up-tail-base"])
    assert base_len >= 2 * block_size and base_len % block_size == 0
    assert prefills.pop("warm-up-tail-base")[0] == 0
    assert prefills == {f"warm-up-tail-{n}": (base_len, n) for n in range(1, MAX_TAIL + 1)}
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and not llm.engine.block_manager.cached


def test_cached_tail_prompts_need_room_for_a_base_and_a_tail():
    from foretell.engine.warm_up import cached_tail_prompts

    assert cached_tail_prompts(47, 16, 100) == {}  # 47 - 16 = 31: less than two blocks
    prompts = cached_tail_prompts(48, 16, 100)
    assert len(prompts["warm-up-tail-base"]) == 32 and len(prompts) == 17
    assert all(0 <= t < 100 for tokens in prompts.values() for t in tokens)


def test_warm_up_is_off_by_default_on_cpu_and_checks_its_value(qwen3_checkpoint):
    assert LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64).engine.warm_up_seconds == 0.0
    with pytest.raises(ValueError, match="warm_up must be auto, on or off"):
        LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, warm_up="yes")
