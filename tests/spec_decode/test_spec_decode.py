"""The gate for every speculative method: greedy output with speculation equals greedy output
without it, token for token, across k, mixed batches, chunked prefill and preemption. Plus:
a draft equal to the target is always accepted (greedy and T=1), metrics add up, bad configs."""

from __future__ import annotations

import pytest

from fixtures.spec_prompts import PROMPTS, STRESS
from foretell import LLM, SamplingParams

MAX_TOKENS = 24


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(qwen3_checkpoint):
    return ids(LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128).generate(PROMPTS, greedy(), use_tqdm=False))


def spec_config(method: str, k: int, request) -> dict:
    config = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        config["model"] = request.getfixturevalue("qwen3_tied_checkpoint")  # a different LM
    elif method == "eagle3":
        config["model"] = request.getfixturevalue("eagle3_head")
    elif method == "eagle3_specforge":
        config.update(method="eagle3", model=request.getfixturevalue("eagle3_head_specforge"))
        config["draft_block_size"] = 2
    elif method == "draft_model_self":
        config.update(method="draft_model", model=request.getfixturevalue("qwen3_checkpoint"))
    return config


def check_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_requests_running"] == 0 and not llm.engine.runner.host_step.draft_probs


@pytest.mark.parametrize("mode", ["batch", "stress"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "eagle3_specforge", "draft_model_self"])
def test_greedy_speculation_equals_plain_greedy(qwen3_checkpoint, baseline, method, k, mode, request):
    options = dict(STRESS) if mode == "stress" else dict(num_kv_blocks=128)
    llm = LLM(qwen3_checkpoint, dtype="float32", speculative_config=spec_config(method, k, request), **options)
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == baseline
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0 or method == "ngram"
    if method == "draft_model_self":
        assert stats["acceptance_rate"] == 1.0
    if mode == "stress":
        assert stats["num_preemptions"] > 0
    check_blocks_free(llm)


def test_self_draft_is_always_accepted_when_sampling(qwen3_checkpoint, monkeypatch):
    # The host step samples drafts from the drafter's distribution (q = p here); the padded step's
    # draft loop drafts greedily (one-hot q, exact but accepted with probability p(d):
    # runner/graphed_verify.py), so this holds on the host step, where every verify runs here.
    from foretell.runner.graphed_verify import GraphedVerify

    spec = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 3}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    padded = [kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, GraphedVerify)]
    assert padded
    for kind in padded:
        kind.enabled = False  # every verify on the host step
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=5)
    llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.get_stats()
    # p / q is 1 up to float rounding between the catch-up and the verify forward.
    assert stats["acceptance_rate"] > 0.99
    check_blocks_free(llm)


def test_metrics_add_up(qwen3_checkpoint, request):
    k = 3
    llm = LLM(qwen3_checkpoint, num_kv_blocks=128, speculative_config=spec_config("ngram", k, request))
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    s = llm.get_stats()
    assert len(s["accepted_per_position"]) == k and len(s["accepted_count_histogram"]) == k + 1
    assert sum(s["accepted_count_histogram"]) == s["num_drafts"] > 0
    assert sum(s["accepted_per_position"]) == s["num_accepted_tokens"]
    assert sum(a * c for a, c in enumerate(s["accepted_count_histogram"])) == s["num_accepted_tokens"]
    assert s["accepted_per_position"] == sorted(s["accepted_per_position"], reverse=True)
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert s["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"])
    assert s["generation_tokens_total"] == sum(len(o.outputs[0].token_ids) for o in outs)
    line = llm.engine.metrics.spec.log_line()
    assert line.startswith("spec: acceptance") and "accepted 0/1/2/3 = " in line


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle3", "num_speculative_tokens": 3}, "needs a draft model folder"),
        ({"method": "draft_model"}, "needs a draft model folder"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa"}, "must be one of"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "foo": 1}, "unknown speculative_config keys"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        ('{"method": ', "not valid JSON"),
    ],
)
def test_bad_speculative_configs(qwen3_checkpoint, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_checkpoint, num_kv_blocks=16, speculative_config=config)


def test_draft_model_with_another_tokenizer_is_refused(qwen3_checkpoint, tmp_path):
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(qwen3_checkpoint, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(iter(vocab))
    vocab[token + "_other"] = vocab.pop(token)
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(qwen3_checkpoint, num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(draft)})



def test_no_drafts_past_max_tokens(qwen3_checkpoint):
    """A verify emits up to k + 1 tokens; near max_tokens the drafts are trimmed so that nothing
    is drafted, verified and then thrown away."""
    spec = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 5}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, speculative_config=spec)
    out = llm.generate(["The cat"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    s = llm.get_stats()
    assert len(out.token_ids) == 9 and s["acceptance_rate"] == 1.0
    # 1 token from the prefill, then every verify emits its accepted drafts plus one.
    assert 1 + s["num_accepted_tokens"] + s["num_drafts"] == 9


def test_ngram_lookup_prefers_the_most_recent_match_and_continues_loops():
    from foretell.spec_decode.ngram import lookup

    assert lookup([7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 2, 1, 3) == [4, 5]  # the latest "1 2", not the first
    assert lookup([5, 8, 8, 8], 3, 1, 3) == [8, 8, 8]  # a loop of one token: not just one proposal
    assert lookup([4, 1, 2, 3, 1, 2], 4, 2, 2) == [3, 1, 2, 3]  # period 3 continued past the end
    assert lookup([1, 2, 3], 3, 1, 3) == []  # nothing repeats


def test_cap_accepted_keeps_the_first_limit_plus_one_tokens():
    import torch

    from foretell.spec_decode.rejection_sampler import VerifyResult, cap_accepted

    verify = VerifyResult([3, 1, 2], [[5, 6, 7, 8], [9, 4], [1, 2, 3]], [[0, 1, 2, 3], [4, 5], [8, 9, 10]],
                          torch.tensor([5, 6, 7, 8, 9, 4, 1, 2, 3]))
    capped = cap_accepted(verify, [1, None, 5])
    assert capped.num_accepted == [1, 1, 2]
    assert capped.output_token_ids == [[5, 6], [9, 4], [1, 2, 3]]  # 6 is the accepted second draft
    assert capped.emitted_rows == [[0, 1], [4, 5], [8, 9, 10]]
    assert capped.emitted_tokens.tolist() == [5, 6, 9, 4, 1, 2, 3]
    assert cap_accepted(verify, [None, 1, 2]) is verify  # nothing over its limit: unchanged
