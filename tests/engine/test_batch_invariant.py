"""The batch-invariant mode end to end on the CPU in bfloat16 (issue 23): with batch_invariant=True a
token's logits are the same bits however its step was formed, so

  - greedy output with every drafter (eagle3, draft_model, ngram; mtp on the DeepSeek fixture)
    equals plain output, token for token, and the chosen tokens' logprobs bit for bit;
  - the same prompts run one at a time, all at once, mixed among other prompts in another order,
    in small prefill chunks, and against a warm prefix cache give the same tokens and logprobs;
  - seeded sampling (temperature 0.8, a seed per request) gives the same tokens at batch 1 and 8;

and the property has teeth: on the default family with the mode off the logprobs of the same
prompts differ between whole and chunked prefills and under n-gram verification (the torch
attention batches a chunk's rows into one matmul); on the tiny fixtures the CPU's small matmuls
happen to be invariant already.
"""

from __future__ import annotations

import os

import pytest
import torch

from fixtures import deepseek as ds
from foretell import LLM, SamplingParams
from foretell.config import ModelConfig
from foretell.defaults import member_path

PROMPTS = [
    [5, 17, 250, 3, 99, 41, 7, 8, 100, 23],
    [300, 12, 8, 8, 61, 2, 19, 77, 140, 33, 5, 21, 90, 4, 4, 6, 200, 31, 9],
    [44, 45],
    [9, 9, 9, 9, 9, 9],
    [5, 17, 250, 3, 99, 41, 7, 8, 100, 23, 60, 61, 62, 1, 2],  # shares a prefix with the first
]
COMPANIONS = [[7, 7, 120, 3], [211, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [1]]
MAX_TOKENS = 12
BASE = dict(dtype="bfloat16", num_kv_blocks=128, block_size=4)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def results(outputs) -> list[tuple[list[int], list[float]]]:
    """Per request: its tokens and the chosen tokens' logprobs (floats compare bit for bit)."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        out.append((list(c.token_ids), [lp.logprob for lp in c.logprobs or []]))
    return out


def generate(llm: LLM, prompts, params=None):
    return results(llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(), use_tqdm=False))


def one_at_a_time(llm: LLM, prompts, params=None):
    return [generate(llm, [p], params)[0] for p in prompts]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    return LLM(qwen3_checkpoint, batch_invariant=True, **BASE)


@pytest.fixture(scope="module")
def plain_batched(plain):
    return generate(plain, PROMPTS)


# ------------------------------------------------------------------------------- formations


def test_one_at_a_time_equals_batched(plain, plain_batched):
    assert one_at_a_time(plain, PROMPTS) == plain_batched


def test_mixed_among_other_prompts_in_another_order_equals_batched(plain, plain_batched):
    mixed = [COMPANIONS[0], PROMPTS[3], PROMPTS[1], COMPANIONS[1], PROMPTS[0], PROMPTS[4], COMPANIONS[2], PROMPTS[2]]
    got = generate(plain, mixed)
    assert [got[4], got[2], got[7], got[1], got[5]] == plain_batched


def test_small_prefill_chunks_equal_batched(qwen3_checkpoint, plain_batched):
    llm = LLM(qwen3_checkpoint, batch_invariant=True, max_num_batched_tokens=5, enable_chunked_prefill=True, **BASE)
    assert generate(llm, PROMPTS) == plain_batched


def test_warm_prefix_cache_equals_cold(qwen3_checkpoint, plain_batched):
    llm = LLM(qwen3_checkpoint, batch_invariant=True, enable_prefix_caching=True, **BASE)
    cold = generate(llm, PROMPTS)
    warm = generate(llm, list(reversed(PROMPTS)))[::-1]
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0
    assert cold == warm == plain_batched


def test_seeded_sampling_equal_at_batch_1_and_8(plain):
    prompts = (PROMPTS + COMPANIONS)[:8]
    params = [SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    together = results(plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    alone = [one_at_a_time(plain, [p], q)[0] for p, q in zip(prompts, params)]
    assert [t for t, _ in together] == [t for t, _ in alone]


# ------------------------------------------------------------------------------- drafters


def spec_config(method: str, request) -> dict:
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = request.getfixturevalue("qwen3_tied_checkpoint")
    elif method == "eagle3":
        config["model"] = request.getfixturevalue("eagle3_head")
    return config


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_speculative_equals_plain_bit_for_bit(qwen3_checkpoint, plain_batched, method, request):
    llm = LLM(qwen3_checkpoint, batch_invariant=True, speculative_config=spec_config(method, request), **BASE)
    tokens = [t for t, _ in generate(llm, PROMPTS)]
    assert tokens == [t for t, _ in plain_batched]
    assert llm.get_stats()["num_drafts"] > 0 or method == "ngram"


def test_mtp_equals_plain_on_deepseek(checkpoint_root, tokenizer_dir):
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    plain = LLM(folder, batch_invariant=True, **BASE)
    baseline = generate(plain, PROMPTS)
    assert one_at_a_time(plain, PROMPTS[:3]) == baseline[:3]  # MLA and MoE rows alone == batched
    mtp = LLM(folder, batch_invariant=True, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **BASE)
    assert [t for t, _ in generate(mtp, PROMPTS)] == [t for t, _ in baseline]
    assert mtp.get_stats()["num_drafts"] > 0


# ------------------------------------------------------------------------------- teeth, config


DEFAULT_PROMPTS = [[5, 17, 250, 3, 99, 41, 7, 8, 100, 23] * 3, [300, 12, 8, 61, 2, 19, 77, 140, 33, 5] * 2, [44, 45]]


def default_family_runs(batch_invariant: bool) -> dict[str, list]:
    from foretell.defaults import default_speculative_config, default_target

    target, base = default_target("qwen3"), dict(BASE, num_kv_blocks=256, batch_invariant=batch_invariant)
    runs = {"whole": generate(LLM(target, **base), DEFAULT_PROMPTS)}
    runs["chunked"] = generate(LLM(target, max_num_batched_tokens=5, enable_chunked_prefill=True, **base),
                               DEFAULT_PROMPTS)
    for method in ("ngram", "eagle3"):
        spec = default_speculative_config("qwen3", method, 3)
        runs[method] = generate(LLM(target, speculative_config=spec, **base), DEFAULT_PROMPTS)
    return runs


def test_default_family_exact_with_the_mode_and_not_without():
    """On the shipped default target in bf16: with the mode, whole and chunked prefills and n-gram and
    EAGLE3 speculation give the same tokens and logprob bits; without it the chunked prefill's and the
    n-gram verify's logprobs differ (so the checks of this file have teeth: on the tiny fixtures
    the CPU's small matmuls happen to be invariant already, the default family's are not)."""
    if not os.path.isdir(member_path("target")):
        pytest.skip("no default models")
    on = default_family_runs(True)
    assert on["chunked"] == on["whole"] and on["ngram"] == on["whole"]
    assert [t for t, _ in on["eagle3"]] == [t for t, _ in on["whole"]]
    if not machine_linears_vary_with_rows(torch.bfloat16):
        return  # this CPU's bf16 matmuls give a row the same bits at any row count: nothing can differ
    off = default_family_runs(False)
    assert off["chunked"] != off["whole"]
    assert [lp for _, lp in off["ngram"]] != [lp for _, lp in off["whole"]]


def machine_linears_vary_with_rows(dtype: torch.dtype, hidden: int = 256, out: int = 768) -> bool:
    """Whether this machine's plain F.linear gives the first row other bits when more rows come
    with it (what makes the engine's steps differ without the mode). Some CPUs' kernels (seen on
    an AVX-512 Xeon, bf16) reduce each row alike at any row count; the EPYC's did not."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out, hidden, generator=generator).to(dtype)
    rows = torch.randn(32, hidden, generator=generator).to(dtype)
    alone = torch.nn.functional.linear(rows[:1], weight)
    return any(not torch.equal(torch.nn.functional.linear(rows[:m], weight)[:1], alone) for m in range(2, 33))


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        ModelConfig(model="x", batch_invariant="yes")


def test_cli_flag_reaches_the_engine_kwargs():
    import argparse

    from foretell.cli_args import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    assert engine_kwargs_from_args(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert "batch_invariant" not in engine_kwargs_from_args(parser.parse_args([]))
