"""On a CUDA GPU: adaptive speculation seeds its step costs at start-up from timed replays of the
captured verify and draft-loop graphs (runner/startup_costs.py): every power-of-two batch up to
max_num_seqs gets a positive prior per k, rising with the verify rows (a bigger draft never costs
less device time at the largest batch), within the time cap; the replays' KV writes leave
nothing behind (greedy fp32 output equals plain decoding's); and the seeded costs need no timed
step (exploration only for acceptance)."""

from __future__ import annotations

from foretell import LLM, SamplingParams
from foretell.runner.startup_costs import BUDGET_SECONDS

PROMPTS = ["The cat reads the book. The cat", "a b a b a b a b", "Question: what is 3 plus 7? Answer:"]


def test_adaptive_costs_are_seeded_from_graph_replays(qwen3_checkpoint, eagle3_head):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    plain = LLM(qwen3_checkpoint, **options).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(qwen3_checkpoint, speculative_config={"method": "eagle3", "model": eagle3_head,
                                                    "num_speculative_tokens": "auto"}, **options)
    costs = llm.get_stats()["adaptive_step_costs"]
    assert costs["batch_sizes"] == [1, 2, 4, 8, 16]
    assert all(row is not None and all(ms > 0 for ms in row) for row in costs["prior_ms"])
    assert 0 < costs["startup_seconds"] < BUDGET_SECONDS + 2
    assert costs["prior_ms"][-1][-1] > costs["prior_ms"][-1][0]  # 16 x 5 rows and 4 drafts cost more than 16 x 1
    policy = llm.engine.adaptive
    assert all(not policy.costs.needs_timing(b) for b in costs["batch_sizes"])
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert policy.num_exploring_steps == policy.num_explorations  # none held a step to time a cost
    print(f"start-up timing {costs['startup_seconds']} s; priors (ms) {costs['prior_ms']}")
