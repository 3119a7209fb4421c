"""Requests that run to max_model_len, for every drafter, and failures that stay with one request.

The checkpoints here are the tiny fixtures with max_position_embeddings cut to the engine's
max_model_len (EAGLE3 head, draft LM and MTP layers included), so their rotary tables end exactly
at the limit, as the shipped default family's do: a draft row placed past it raises, as it did
before the fix (issue 32: `index 2048 is out of bounds for dimension 0 with size 2048`).

Greedy requests without max_tokens run to exactly max_model_len and finish with "length", with
the plain (no speculation) engine's tokens, alone and beside requests that stop earlier. Then:
a step that fails for one sequence fails that request alone (finish_reason "error",
RequestOutput.error) while the others go on unchanged; a step that fails for a reason no one
request owns fails the requests of that step, and the engine, its KV blocks all free again,
serves the next requests as before.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from fixtures import deepseek as ds
from foretell import LLM, SamplingParams
from foretell.engine import output_processor
from foretell.engine.errors import SequenceError

MAX_LEN = 64


def short_context(folder: str, dest: str, max_positions: int = MAX_LEN) -> str:
    """`folder` with max_position_embeddings = max_positions (files linked, config rewritten)."""
    if not os.path.isdir(dest):
        os.makedirs(dest)
        for name in os.listdir(folder):
            if name != "config.json":
                os.symlink(os.path.join(folder, name), os.path.join(dest, name))
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config["max_position_embeddings"] = max_positions
        with open(os.path.join(dest, "config.json"), "w") as f:
            json.dump(config, f)
    return dest


@pytest.fixture(scope="module")
def short(checkpoint_root, tokenizer_dir, qwen3_checkpoint, qwen3_tied_checkpoint, eagle3_head):
    """name -> short-context folder: the Qwen3 target, its EAGLE3 head, another LM as draft, and
    the DeepSeek-V3 fixture (one MTP layer) with an EAGLE3 head whose draft layer is MLA, and
    the Kimi-K2 fixture (two MTP layers)."""
    def cut(name, folder):
        return short_context(folder, os.path.join(checkpoint_root, f"short{MAX_LEN}_{name}"))

    v3 = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    kimi_k2 = ds.checkpoint(checkpoint_root, tokenizer_dir, "kimi_k2")  # two MTP layers, used in turn
    mla_head = os.path.join(checkpoint_root, "context_limit_mla_head")
    if not os.path.isdir(mla_head):
        ds.write_eagle3_mla_head(mla_head, ds.read_config(v3), aux_ids=[0, 1, 2])
    return {
        "qwen3_long": qwen3_checkpoint,
        "qwen3": cut("qwen3", qwen3_checkpoint),
        "eagle3": cut("eagle3", eagle3_head),
        "draft": cut("draft", qwen3_tied_checkpoint),
        "v3": cut("v3", v3),
        "kimi_k2": cut("kimi_k2", kimi_k2),
        "mla_head": cut("mla_head", mla_head),
    }


# name -> (target, speculative_config) over the `short` folders
DRAFTERS = {
    "none": ("qwen3", None),
    "ngram": ("qwen3", {"method": "ngram", "num_speculative_tokens": 3}),
    "eagle3": ("qwen3", {"method": "eagle3", "model": "eagle3", "num_speculative_tokens": 3}),
    "draft_model": ("qwen3", {"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}),
    # A self-draft accepts everything: each verify emits k + 1 tokens, the last past the limit.
    "draft_model_self": ("qwen3", {"method": "draft_model", "model": "qwen3", "num_speculative_tokens": 3}),
    "mtp": ("v3", {"method": "mtp", "num_speculative_tokens": 3}),
    "mtp_two_layers": ("kimi_k2", {"method": "mtp", "num_speculative_tokens": 3}),
    "eagle3_mla": ("v3", {"method": "eagle3", "model": "mla_head", "num_speculative_tokens": 3}),
}


def build(short, name: str, **options) -> LLM:
    target, spec = DRAFTERS[name]
    if spec is not None and "model" in spec:
        spec = dict(spec, model=short[spec["model"]])
    llm = LLM(short[target], dtype="float32", num_kv_blocks=64, speculative_config=spec, **options)
    assert llm.engine.max_model_len == MAX_LEN
    return llm


def prompt(length: int, seed: int) -> dict:
    """A prompt of `length` ids that repeats itself (so n-gram drafting finds matches)."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, 200) for _ in range(5)]
    return {"prompt_token_ids": [motif[i % 5] if i % 7 else rng.randrange(3, 200) for i in range(length)]}


def to_limit() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert not llm.engine.runner.host_step.draft_probs


PROMPT_LENGTHS = (MAX_LEN - 13, MAX_LEN - 4, MAX_LEN - 2, MAX_LEN - 1)


@pytest.fixture(scope="module")
def plain(short):
    """The plain engine's outputs per target: each prompt alone, to the limit."""
    out = {}
    for target in ("qwen3", "v3", "kimi_k2"):
        llm = LLM(short[target], dtype="float32", num_kv_blocks=64)
        out[target] = {
            (n, seed): token_ids(llm.generate([prompt(n, seed)], to_limit(), use_tqdm=False))[0]
            for n in PROMPT_LENGTHS + (20,) for seed in (0, 1)
        }
    return out


def record_verify_ends(llm: LLM, monkeypatch) -> list[int]:
    """Where each scheduled verify's last row lands (its position + 1), as the steps run."""
    ends: list[int] = []
    original = llm.engine.scheduler.schedule

    def recording():
        out = original()
        ends.extend(i.seq.num_computed_tokens + i.num_new_tokens for i in out.scheduled if i.draft_token_ids)
        return out

    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording)
    return ends


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_requests_run_to_exactly_max_model_len(short, plain, name, seed, monkeypatch):
    llm = build(short, name)
    verify_ends = record_verify_ends(llm, monkeypatch)
    expected = plain[DRAFTERS[name][0]]
    for n in PROMPT_LENGTHS:  # batch 1
        out = llm.generate([prompt(n, seed)], to_limit(), use_tqdm=False)[0]
        assert out.error is None
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == MAX_LEN - n
        assert out.outputs[0].token_ids == expected[(n, seed)], n
    assert_all_free(llm)
    # Drafts were verified right up to the last position (seed 0's continuation never repeats
    # itself: n-gram finds nothing to propose there).
    if name != "none" and (name, seed) != ("ngram", 0):
        assert max(verify_ends) == MAX_LEN, verify_ends


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_limit_beside_requests_that_stop_earlier(short, plain, name, monkeypatch):
    """One batch: requests reaching the limit at different steps, one that stops well before it
    (max_tokens), and one arriving later; each equals what it produces alone."""
    llm = build(short, name)
    expected = plain[DRAFTERS[name][0]]
    prompts = [prompt(n, 1) for n in PROMPT_LENGTHS] + [prompt(20, 1)]
    params = [to_limit()] * len(PROMPT_LENGTHS) + [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    verify_ends = record_verify_ends(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if name != "none":
        assert max(verify_ends) == MAX_LEN, verify_ends
    for n, out in zip(PROMPT_LENGTHS, outs):
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == expected[(n, 1)], n
    assert outs[-1].outputs[0].token_ids == expected[(20, 1)][:30]
    assert_all_free(llm)


def test_sampled_requests_reach_the_limit(short):
    llm = build(short, "eagle3")
    params = SamplingParams(temperature=0.8, max_tokens=None, ignore_eos=True, seed=5)
    outs = llm.generate([prompt(n, 2) for n in PROMPT_LENGTHS], params, use_tqdm=False)
    for n, out in zip(PROMPT_LENGTHS, outs):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == MAX_LEN - n
    assert_all_free(llm)


def test_a_draft_model_with_a_shorter_context_bounds_max_model_len(short):
    spec = {"method": "draft_model", "model": short["draft"], "num_speculative_tokens": 2}
    llm = LLM(short["qwen3_long"], dtype="float32", num_kv_blocks=64, speculative_config=spec)
    assert llm.engine.max_model_len == MAX_LEN  # the draft's rotary table ends there
    out = llm.generate([prompt(MAX_LEN - 4, 0)], to_limit(), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(ValueError, match=r"max_model_len 100 is larger than the draft model's "
                                         r"max_position_embeddings 64"):
        LLM(short["qwen3_long"], dtype="float32", num_kv_blocks=64, max_model_len=100, speculative_config=spec)


# ---------------------------------------------------------------- failures that stay with one request


def mixed_prompts() -> tuple[list[dict], list[SamplingParams]]:
    prompts = [prompt(12, 3), prompt(30, 4), prompt(9, 5)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 3


@pytest.fixture(scope="module")
def plain_mixed(short):
    llm = LLM(short["qwen3"], dtype="float32", num_kv_blocks=64)
    prompts, params = mixed_prompts()
    return [token_ids(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params)]


def fail_once(monkeypatch, owner, attribute: str, error_for):
    """Wrap owner.attribute: its n-th call raises error_for(n, *args) when that is not None."""
    original = getattr(owner, attribute)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        error = error_for(len(calls), *args)
        if error is not None:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, wrapped)
    return calls


def running_seq(llm: LLM, prompt_ids: dict):
    """The running sequence whose prompt is prompt_ids (None when it is not running)."""
    ids = prompt_ids["prompt_token_ids"]
    return next((s for s in llm.engine.scheduler.running if s.token_ids[: len(ids)] == ids), None)


@pytest.mark.parametrize("name", ["eagle3", "draft_model", "ngram"])
def test_a_bad_draft_fails_its_request_alone(short, plain_mixed, name, monkeypatch):
    """A proposer hands one sequence a draft outside the vocabulary: the runner's check names it
    before the forward, that request ends with finish_reason "error" and a message, the others
    give exactly their tokens, and every block is free again."""
    llm = build(short, name)
    prompts, params = mixed_prompts()
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def poisoned():
        victim = running_seq(llm, prompts[1])
        if victim is not None and victim.num_output_tokens >= 3:
            victim.spec_token_ids = [10**6]  # what the proposer left for its next verify
        return original()

    monkeypatch.setattr(scheduler, "schedule", poisoned)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and outs[1].finished
    assert "draft tokens outside the target's vocabulary" in outs[1].error and "1000000" in outs[1].error
    assert 3 <= len(bad.token_ids) < 16 and bad.token_ids == plain_mixed[1][: len(bad.token_ids)]
    for i in (0, 2):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == plain_mixed[i]
    assert_all_free(llm)


@pytest.mark.parametrize("name", ["eagle3", "draft_model", "eagle3_and_sampled"])
def test_a_sequence_error_inside_the_drafter_fails_its_request_alone(short, plain_mixed, name, monkeypatch):
    """The proposer raises a SequenceError for one sequence after the target's forward (every
    sequence's tokens sampled, its drafts and draft probabilities consumed), in the host step or
    in the padded step's draft loop: the others redo the step without drafts and still give
    exactly their tokens; a sampled request beside them ends normally."""
    llm = build(short, "eagle3" if name == "eagle3_and_sampled" else name)
    prompts, params = mixed_prompts()
    if name == "eagle3_and_sampled":
        prompts.append(prompt(15, 6))
        params = params + [SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=2)]

    calls = []  # the drafter's calls in either step form: propose (host step), padded_catch_up

    def error_for(call, *args):
        calls.append(1)
        if len(calls) != 4:
            return None
        return SequenceError(running_seq(llm, prompts[0]).seq_id, "the drafter could not handle this sequence")

    for entry in ("propose", "padded_catch_up"):
        fail_once(monkeypatch, llm.engine.runner.proposer, entry, error_for)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) > 4
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].error.endswith("the drafter could not handle this sequence")
    for i in (1, 2):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == plain_mixed[i]
    if name == "eagle3_and_sampled":
        assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 16
    assert_all_free(llm)


def test_a_failure_after_the_tokens_fails_that_request_alone(short, plain_mixed, monkeypatch):
    """Processing one request's new tokens raises (here its detokenizer): that request fails,
    the rest of the step's results still apply."""
    llm = build(short, "eagle3")
    prompts, params = mixed_prompts()
    original = output_processor.apply_stop_strings
    victim_prompt = prompts[2]["prompt_token_ids"]

    def broken(seq, detok, appended, scheduler):
        if seq.token_ids[: len(victim_prompt)] == victim_prompt and seq.num_output_tokens > 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return original(seq, detok, appended, scheduler)

    monkeypatch.setattr(output_processor, "apply_stop_strings", broken)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in outs[2].error
    for i in (0, 1):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == plain_mixed[i]
    assert_all_free(llm)


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_a_step_failure_no_request_owns_leaves_the_engine_usable(short, plain_mixed, where, monkeypatch):
    """A failure of the whole batch (not pinned on a sequence): the requests of that step end
    with "error", a request still waiting for its turn is served normally, no KV block leaks,
    and the next generate() gives the plain tokens."""
    llm = build(short, "eagle3", max_num_seqs=2)
    runner = llm.engine.runner
    # Either step form: the target model's forward; the drafter's propose (host step) or
    # padded_catch_up (the padded step's draft loop).
    entries = [(runner.model, "forward")] if where == "target" else [
        (runner.proposer, "propose"), (runner.proposer, "padded_catch_up")]
    calls = []

    def error_for(call, *args):
        calls.append(1)
        return RuntimeError("CUDA error: an illegal memory access was encountered") if len(calls) == 3 else None

    for owner, attribute in entries:
        fail_once(monkeypatch, owner, attribute, error_for)
    prompts, params = mixed_prompts()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs[:2]] == ["error", "error"]
    assert all("RuntimeError: CUDA error" in o.error for o in outs[:2])
    assert outs[2].error is None and outs[2].outputs[0].token_ids == plain_mixed[2]  # it was waiting
    assert_all_free(llm)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(again) == plain_mixed
    assert_all_free(llm)
