"""Grammar-forced tokens as drafts (foretell/structured/forced_drafts.py, issue 27).

- drafts_under_grammar against an independent reference (Python's `regex`, partial matching over
  decoded texts): the run appended after the drafts is text the pattern forces (every other
  continuation fails), the proposer's draft at a forced position is replaced by the forced token,
  a rejected draft cuts the rest, an EOS is kept only where the output may end, drafts drawn from
  a distribution are never cut or replaced, max_drafts bounds the total, and the matcher ends
  where it started;
- StructuredOutputs.grammar_drafts: one-hot draft probabilities for forced drafts appended to a
  sampled request's drawn drafts;
- SpecDecodeStats counts a verify of more drafts than k;
- the engine: greedy output with grammar + speculation equals plain greedy output with the
  grammar for eagle3, draft_model, ngram (Qwen3 fixture) and mtp (DeepSeek-V3 fixture), with
  forced drafts counted; a model drafter's grammar requests verify on the padded step, which
  holds at most k drafts (structured/padded_verify.py), n-gram's on the CPU's host step, where
  verifies of more than k drafts take place; sampled output with a draft model keeps the plain
  target's distribution over token sequences (chi-square) with forced drafts appended.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import regex
import torch

from fixtures import deepseek as ds
from fixtures.grammar_stubs import (
    VOCAB, FakeSeq, SamplingItem, StepResult, encode, forced_text_of, mask_of, regex_sequence,
)
from fixtures.padded_step import host_step_for_host_drafters
from fixtures.chi_square import chi2_999, chi_square_two_samples
from foretell import LLM, SamplingParams
from foretell.spec_decode.metrics import SpecDecodeStats
from foretell.structured.forced_drafts import drafts_under_grammar

# A fixed stretch after the first free characters, then a free choice, then fixed text again.
PATTERN = r"[0-9]{1,2}-abcab-(x|yy)ba\."


def forced_text(prefix: str) -> str:
    return forced_text_of(PATTERN, prefix, "0123456789-abcxy.")


def matcher_for(runtime, hf, output: str, temperature: float = 0.0, seq_id: int = 1):
    return regex_sequence(runtime, hf, PATTERN, output, temperature, seq_id)


def test_the_forced_run_follows_the_drafts(runtime, hf):
    matcher, _ = matcher_for(runtime, hf, "1")
    before = mask_of(matcher, runtime)
    drafts = encode(hf, "2-ab")  # "12-ab": the pattern forces "cab-" next
    shaped = drafts_under_grammar(matcher, drafts, replaceable=True, max_drafts=None)
    assert shaped.token_ids[: len(drafts)] == drafts and shaped.num_replaced == 0
    appended = hf.decode(shaped.token_ids[len(drafts):])
    assert shaped.num_forced == len(shaped.token_ids) - len(drafts) > 0
    assert forced_text("12-ab") == "cab-" and appended and "cab-".startswith(appended)
    assert (mask_of(matcher, runtime) == before).all() and matcher.num_consumed == 1  # unmoved


def test_a_draft_at_a_forced_position_is_replaced(runtime, hf):
    matcher, _ = matcher_for(runtime, hf, "12-abcab-yy")  # "ba." forced
    wrong = encode(hf, "x")  # the grammar rejects it; a drafter might still propose it
    shaped = drafts_under_grammar(matcher, wrong + wrong, replaceable=True, max_drafts=None)
    assert shaped.num_replaced == 2 and shaped.num_forced == len(shaped.token_ids) > 0
    assert "ba.".startswith(hf.decode(shaped.token_ids)) and forced_text("12-abcab-yy") == "ba."
    # Drawn drafts stay as they were: rejection sampling judges them.
    assert drafts_under_grammar(matcher, wrong + wrong, replaceable=False, max_drafts=None).token_ids == wrong + wrong


def test_rejected_drafts_cut_and_eos_ends(runtime, hf):
    eos = hf.eos_token_id
    matcher, _ = matcher_for(runtime, hf, "12-abcab-")  # "x" or "yy": nothing forced
    assert forced_text("12-abcab-") == ""
    bad = encode(hf, "zz")
    assert drafts_under_grammar(matcher, bad, True, None).token_ids == []
    assert drafts_under_grammar(matcher, bad, False, None).token_ids == bad
    assert drafts_under_grammar(matcher, [eos], True, None).token_ids == []  # the output cannot end here
    done, _ = matcher_for(runtime, hf, "12-abcab-xba.", seq_id=2)
    assert drafts_under_grammar(done, [eos, eos], True, None).token_ids == [eos]  # it may: nothing after
    assert drafts_under_grammar(done, [], True, None).token_ids == []  # complete: nothing forced


def test_max_drafts_bounds_the_total(runtime, hf):
    matcher, _ = matcher_for(runtime, hf, "1")
    drafts = encode(hf, "2-ab")
    unbounded = drafts_under_grammar(matcher, drafts, True, None).token_ids
    assert len(unbounded) > len(drafts) + 1
    assert drafts_under_grammar(matcher, drafts, True, len(drafts) + 1).token_ids == unbounded[: len(drafts) + 1]
    assert drafts_under_grammar(matcher, drafts, True, len(drafts)).token_ids == drafts
    assert drafts_under_grammar(matcher, [], True, 0).token_ids == []


def test_sampled_drafts_get_one_hot_rows_for_forced_drafts(runtime, hf):
    drafts = encode(hf, "2-ab")
    items, results, probs = [], [], []
    for seq_id, (temperature, has_probs) in enumerate([(1.0, True), (1.0, False), (0.0, True)], start=10):
        params = SamplingParams(temperature=temperature, structured_outputs={"regex": PATTERN})
        items.append(SamplingItem(FakeSeq(params, [], frozenset({hf.eos_token_id}), seq_id)))
        results.append(StepResult(encode(hf, "1"), list(drafts)))
        probs.append(torch.softmax(torch.randn(len(drafts), VOCAB), dim=-1) if has_probs else None)
    out = runtime.grammar_drafts(items, results, probs, max_drafts=None)
    shaped = results[0].next_drafts
    assert len(shaped) > len(drafts) and all(r.next_drafts == shaped for r in results)
    forced = torch.tensor(shaped[len(drafts):])
    assert out[0].shape == (len(shaped), VOCAB) and torch.equal(out[0][: len(drafts)], probs[0])
    assert torch.equal(out[0][len(drafts):], torch.nn.functional.one_hot(forced, VOCAB).float())
    assert out[1] is None and out[2] is probs[2]  # deterministic drafts; greedy (no q kept)
    assert runtime.timer.forced_drafts == 3 * len(forced)


def test_stats_count_a_verify_past_k():
    stats = SpecDecodeStats(2)
    stats.record(2, 1)
    stats.record(6, 5)
    assert stats.num_draft_tokens == 8 and stats.num_accepted_tokens == 6
    assert stats.accepted_per_position == [2, 1, 1, 1, 1]
    assert stats.accepted_count_histogram == [0, 1, 0, 0, 0, 1]
    assert stats.mean_acceptance_length == 4.0


# ---- the engine ---------------------------------------------------------------------------
PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b"]
# Long fixed stretches between short free parts: forced runs longer than k = 2.
ENGINE_REGEX = r"(the|cat|[0-9]{1,2}) reads the book, (the|a) cat reads the book\."


def greedy_run(llm: LLM, prompts) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": ENGINE_REGEX})
    before = llm.get_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and regex.fullmatch(ENGINE_REGEX, out.outputs[0].text)
    return [o.outputs[0].token_ids for o in outs], {k: v for k, v in llm.get_stats().items()
                                                    if k not in before or before[k] != v}


def spec_config(method: str, request) -> dict:
    config = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        config["model"] = request.getfixturevalue("qwen3_tied_checkpoint")
    elif method == "eagle3":
        config["model"] = request.getfixturevalue("eagle3_head")
    else:
        config["prompt_lookup_min"] = 1
    return config


@pytest.fixture(scope="module")
def plain_tokens(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        return greedy_run(llm, PROMPTS)[0]


@pytest.mark.parametrize("method, host_step", [("eagle3", False), ("draft_model", False), ("ngram", False),
                                               ("ngram", True)])
def test_greedy_output_with_forced_drafts_equals_plain(method, host_step, request, qwen3_checkpoint, plain_tokens):
    """Every drafter on the padded step (forced drafts up to k, its verify length), and a host
    drafter on the host step (tensor parallelism's path: forced runs past k)."""
    with host_step_for_host_drafters() if host_step else contextlib.nullcontext():
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec_config(method, request))
    with llm:
        tokens, stats = greedy_run(llm, PROMPTS)
        timer = llm.engine.runner.host_step.structured.timer
    assert tokens == plain_tokens
    assert timer.forced_drafts > 0
    if host_step:
        assert len(stats["accepted_per_position"]) > 2  # some verify accepted more than k drafts
    else:
        assert len(stats["accepted_per_position"]) == 2


def test_mtp_greedy_output_with_forced_drafts_equals_plain(checkpoint_root, tokenizer_dir):
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 250, 3, 99, 41, 7], [9, 9, 9, 9])]
    with LLM(folder, dtype="float32", num_kv_blocks=64) as llm:
        plain = greedy_run(llm, prompts)[0]
    with LLM(folder, dtype="float32", num_kv_blocks=64,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        tokens, stats = greedy_run(llm, prompts)
        assert llm.engine.runner.host_step.structured.timer.forced_drafts > 0
    assert tokens == plain
    assert len(stats["accepted_per_position"]) == 2  # the padded step: forced drafts up to k


@pytest.mark.slow  # two engines drawing 400 samples: about 40 s on 2 busy cores
def test_sampled_output_with_forced_drafts_keeps_the_distribution(qwen3_checkpoint, qwen3_tied_checkpoint):
    """A free character, a fixed stretch (forced drafts appended to the draft model's drawn ones
    after a prefill, with one-hot q, and to the padded step's greedy ones), a free character: the token sequences come with the plain
    target's frequencies. The fixture target takes the fixed text's canonical split almost
    surely, so this holds the path (drawn and forced drafts verified together, the probabilities'
    rows, the drafter's catch-up after a long accept) more than q itself, which
    test_sampled_drafts_get_one_hot_rows_for_forced_drafts checks; rejection sampling with a
    one-hot q is what n-gram drafts of sampled requests already go through."""
    params = SamplingParams(temperature=1.0, n=400, seed=7, max_tokens=16,
                            structured_outputs={"regex": r"[abc] the cat reads the book [abc]"})
    counts = []
    for spec in (None, {"method": "draft_model", "model": qwen3_tied_checkpoint, "num_speculative_tokens": 2}):
        with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=512, max_num_seqs=128,
                 speculative_config=spec) as llm:
            out = llm.generate(["a b c"], params, use_tqdm=False)[0]
            if spec is not None:
                assert llm.engine.runner.host_step.structured.timer.forced_drafts > 0
        counts.append(collections.Counter(tuple(o.token_ids) for o in out.outputs))
    stat, dof = chi_square_two_samples(counts[0], counts[1])
    assert dof >= 3 and stat < chi2_999(dof), (stat, dof, counts)
