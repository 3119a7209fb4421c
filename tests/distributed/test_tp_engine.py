"""The engine over 2 tensor-parallel ranks (worker processes, gloo, CPU, float32): LLM(...,
tensor_parallel_size=2) gives the tokens tensor_parallel_size=1 gives, token for token, on the
Llama, Qwen3, DeepSeek-V3 (with MTP) and Kimi-K2.5-layout fixtures, plain and with every drafter
that applies (eagle3, draft_model, ngram, mtp), experts split inside each expert or partitioned
over the ranks (expert parallel); under chunked prefill and preemption; seeded sampling draws the
same tokens. Greedy-only steps gather no whole logits rows (target, verify, MTP drafts); a step
with a sampled request does. A killed worker ends the engine with WorkerDied within seconds; a model that does
not split over the ranks fails at start-up naming the config field.

The reference for greedy runs is one rank without speculation (speculation is lossless, and
tests/spec_decode/test_spec_decode.py holds it to that on one rank). Engines with 2 workers start in
a few seconds each: one TP=2 case per model family runs by default, the rest are marked slow.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from fixtures import deepseek as ds
from foretell import LLM, SamplingParams
from foretell.distributed.executor import WorkerDied

PROMPTS = [[5, 17, 250, 3, 99, 41, 7], [300, 12, 8, 8, 61, 2, 19, 77, 140, 33], [44], [9, 9, 9, 9, 9, 9]]
MAX_TOKENS = 10
STRESS = dict(max_num_batched_tokens=8, num_kv_blocks=9, block_size=4)  # chunks + preemption
ROOMY = dict(num_kv_blocks=64)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def sampled() -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def folders(request, checkpoint_root, tokenizer_dir) -> dict[str, str]:
    """Target name -> folder, and the drafters: "<target>:eagle3" heads, the draft LM."""
    v3 = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    k25 = ds.checkpoint(checkpoint_root, tokenizer_dir, "kimi_k25")
    out = {
        "llama": request.getfixturevalue("llama31_checkpoint"),
        "qwen3": request.getfixturevalue("qwen3_checkpoint"),
        "v3": v3,
        "kimi_k25": k25,
        "qwen3:eagle3": request.getfixturevalue("eagle3_head"),
        "draft_lm": request.getfixturevalue("qwen3_tied_checkpoint"),
    }
    # Kimi's fixture has 3 layers: its head takes the default aux layers (2, N // 2, N - 3).
    heads = (("v3", ds.read_config(v3), [0, 1, 2]), ("kimi_k25", ds.read_config(k25)["text_config"], None))
    for name, config, aux_ids in heads:
        head = os.path.join(checkpoint_root, f"tp_engine_{name}_eagle3_head")
        if not os.path.isdir(head):
            ds.write_eagle3_head(head, config, aux_ids=aux_ids)
        out[f"{name}:eagle3"] = head
    return out


@pytest.fixture(scope="module")
def baselines(folders):
    """One rank, no speculation: target name -> greedy tokens (computed when first asked for)."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            cache[name] = tokens(LLM(folders[name], dtype="float32", **ROOMY), greedy())
        return cache[name]

    return get


def spec_config(folders, target: str, method: str | None, k: int = 2) -> dict | None:
    if method is None:
        return None
    config = {"method": method, "num_speculative_tokens": k}
    if method == "eagle3":
        config["model"] = folders[f"{target}:eagle3"]
    elif method == "draft_model":
        config["model"] = folders["draft_lm"]
    return config


def tp_engine(folders, target: str, method: str | None, expert_parallel: bool = False, **options) -> LLM:
    return LLM(folders[target], dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
               speculative_config=spec_config(folders, target, method), **(options or ROOMY))


DRAFT_STATS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position")


def check_tp_equals_one_rank(folders, baselines, target, method, expert_parallel=False, **options) -> None:
    """Greedy tokens equal one rank's without speculation; with a drafter, the drafts and their
    acceptance equal one rank's with the same drafter (the ranks draft as one device does)."""
    llm = tp_engine(folders, target, method, expert_parallel, **options)
    try:
        assert tokens(llm, greedy()) == baselines(target)
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_requests_running"] == 0
    finally:
        llm.engine.shutdown()
    if method is not None:
        one_rank = LLM(folders[target], dtype="float32", speculative_config=spec_config(folders, target, method),
                       **(options or ROOMY))
        tokens(one_rank, greedy())
        expected = one_rank.get_stats()
        if method != "ngram":  # n-gram drafts only where a random model's output repeats
            assert stats["num_drafts"] > 0
        assert {k: stats[k] for k in DRAFT_STATS} == {k: expected[k] for k in DRAFT_STATS}


# ---------------------------------------------------------------------- TP=2 equals one rank

DEFAULT_CASES = [  # one per model family, run by default
    ("llama", None, False),
    ("v3", "mtp", False),
    ("kimi_k25", None, True),
]
SLOW_CASES = [
    ("llama", "ngram", False),
    ("llama", "draft_model", False),
    ("qwen3", None, False),
    ("qwen3", "ngram", False),
    ("qwen3", "draft_model", False),
    ("v3", None, False),
    ("v3", "mtp", True),
    ("v3", "eagle3", False),
    ("v3", "eagle3", True),
    ("v3", "ngram", False),
    ("v3", "draft_model", True),
    ("kimi_k25", None, False),
    ("kimi_k25", "eagle3", False),
    ("kimi_k25", "eagle3", True),
    ("kimi_k25", "ngram", True),
]


def case_id(case) -> str:
    target, method, ep = case
    return f"{target}-{method or 'plain'}-{'ep' if ep else 'tp'}"


@pytest.mark.parametrize("case", DEFAULT_CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=case_id)
def test_two_ranks_equal_one_rank(folders, baselines, case):
    target, method, expert_parallel = case
    check_tp_equals_one_rank(folders, baselines, target, method, expert_parallel)


def test_qwen3_eagle3_under_chunked_prefill_and_preemption_and_sampling(folders, baselines):
    """EAGLE3 on Qwen3 (the head whole on every rank) in a small cache: greedy equals one rank
    without speculation; seeded sampling (every rank draws from the same noise) equals one rank
    with the same head, both verifying on the padded step (the ranks' runs eagerly over gloo)."""
    spec = spec_config(folders, "qwen3", "eagle3")
    one_rank = LLM(folders["qwen3"], dtype="float32", speculative_config=spec, **STRESS)
    expected_sampled = tokens(one_rank, sampled())
    llm = tp_engine(folders, "qwen3", "eagle3", **STRESS)
    try:
        assert tokens(llm, greedy()) == baselines("qwen3")
        assert llm.get_stats()["num_preemptions"] > 0
        assert tokens(llm, sampled()) == expected_sampled
        assert llm.get_stats()["num_free_kv_blocks"] == llm.get_stats()["num_kv_blocks"]
    finally:
        llm.engine.shutdown()


# ------------------------------------------------- greedy steps gather no whole logits rows


@pytest.mark.parametrize("target, method", [("llama", None), ("qwen3", "eagle3"), ("v3", "mtp")])
def test_greedy_steps_gather_no_logits(folders, baselines, target, method):
    """With every request greedy, no step (target, verify, MTP drafts) gathers whole logits rows
    (each rank's ParallelLMHead counts its gathers), and the tokens equal one rank's; a step
    mixing greedy and sampled requests still gathers them (sampling needs whole rows). Drafts
    are verified on the padded step, run eagerly over gloo, never on the host step."""
    llm = tp_engine(folders, target, method)
    runner = llm.engine.runner
    try:
        state = runner.graph_state()  # gloo ranks: eager, nothing queued ahead (graph_capture.py)
        assert (state["allowed"], state["captured"], state["queue_ahead"]) == (False, False, False)
        before = runner.num_logit_gathers()
        assert tokens(llm, greedy()) == baselines(target)
        assert runner.num_logit_gathers() == before
        if method is not None:
            assert llm.get_stats()["num_drafts"] > 0
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
        outs = llm.generate(prompts, [greedy(), sampled()], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == baselines(target)[0]
        assert runner.num_logit_gathers() > before
        state = runner.graph_state()
        assert state["host_verify_steps"] == 0
        assert (state["padded_verify_steps"] > 0) == (method is not None)
    finally:
        llm.engine.shutdown()


# ------------------------------------------------------------------------------ failures


def test_a_killed_worker_ends_the_engine_within_seconds(folders):
    llm = tp_engine(folders, "llama", None)
    try:
        assert len(tokens(llm, greedy())) == len(PROMPTS)
        pids = llm.engine.runner.executor.pids
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"worker rank 1 .* killed by signal 9"):
            tokens(llm, greedy())
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerDied, match="rank 1"):  # the engine stays ended, it never hangs
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(), use_tqdm=False)
        deadline = time.monotonic() + 10
        while any(process.is_alive() for process in llm.engine.runner.executor.processes):
            assert time.monotonic() < deadline, "the surviving worker was not stopped"
            time.sleep(0.1)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_a_model_that_does_not_split_fails_at_start_up(folders):
    with pytest.raises(ValueError, match=r"worker rank 0 of 3 could not start(.|\n)*tensor_parallel_size = 3 does not divide"):
        LLM(folders["qwen3"], dtype="float32", tensor_parallel_size=3, **ROOMY)


def test_a_sequence_error_crosses_the_process_boundary_whole():
    """A worker's SequenceError reaches the engine with its sequence id (the engine fails that
    request alone, as on one device)."""
    import pickle

    from foretell.engine.errors import SequenceError

    error = pickle.loads(pickle.dumps(SequenceError(3, "sequence 'r' got draft tokens outside the vocabulary")))
    assert isinstance(error, SequenceError) and error.seq_id == 3 and "outside the vocabulary" in str(error)
