"""The token a grammar's fast-forward run holds back, drafted (foretell/structured/forced_drafts.py
forced_tail, issue 27).

- forced_tail against an independent reference (Python's `regex`, partial matching over texts):
  with the tokenizer it drafts the whole forced text, split as the tokenizer splits it alone,
  where llguidance's fast-forward tokens stop before a token more text could merge into; without
  it, only the fast-forward tokens; the limit bounds it; the matcher ends where it started;
- drafts_under_grammar: a draft the grammar rejects is followed by the forced text instead of
  nothing; drawn drafts stay as they were; a sampled request's held-back draft gets a one-hot q;
- the engine: greedy output with the grammar and EAGLE3 speculation equals greedy output with the
  grammar and no speculation, with held-back tokens drafted (the fixture tokenizer merges " read"
  and "s", " token" and "s", a space and the next word).
"""

from __future__ import annotations

import pytest
import regex
import torch

from fixtures.grammar_stubs import (
    VOCAB, FakeSeq, SamplingItem, StepResult, encode, forced_text_of, mask_of, regex_sequence,
)
from foretell import LLM, SamplingParams
from foretell.structured.forced_drafts import drafts_under_grammar, forced_tail

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,-"


def forced_text(pattern: str, prefix: str) -> str:
    return forced_text_of(pattern, prefix, ALPHABET)


sequence = regex_sequence  # (matcher, FakeSeq) of a regex request


# (pattern, output so far): the forced text ends in a token that more text could merge into
HELD_BACK = [
    (r"[ab] read(s|ing)", "a"),  # " read": " reads" is one token
    (r"[ab]( tokens| token)", "b"),  # " token": " tokens" too
    (r"[ab] reads the (a|b)", "a"),  # " reads the ": the space merges into " a" / " b"
]


@pytest.mark.parametrize("pattern,output", HELD_BACK)
def test_the_tail_is_the_forced_text_split_alone(runtime, hf, pattern, output):
    matcher, _ = sequence(runtime, hf, pattern, output)
    before = mask_of(matcher, runtime)
    expected = forced_text(pattern, output)
    fast_forward = matcher.matcher.compute_ff_tokens()
    tail, num_held_back = forced_tail(matcher.matcher, None, runtime._tokenizer().tokenize_bytes)
    assert hf.decode(tail) == expected and tail == encode(hf, expected)
    assert len(fast_forward) < len(tail) and num_held_back >= 1
    assert hf.decode(fast_forward) != expected  # llguidance's own run stops short
    # Without the tokenizer: the fast-forward tokens only.
    assert forced_tail(matcher.matcher, None, None) == (fast_forward, 0)
    assert (mask_of(matcher, runtime) == before).all() and matcher.num_consumed == len(encode(hf, output))


def test_the_limit_bounds_the_tail(runtime, hf):
    matcher, _ = sequence(runtime, hf, *HELD_BACK[0])
    tokenize = runtime._tokenizer().tokenize_bytes
    whole, _ = forced_tail(matcher.matcher, None, tokenize)
    assert len(whole) >= 2
    assert forced_tail(matcher.matcher, 1, tokenize)[0] == whole[:1]
    assert forced_tail(matcher.matcher, 0, tokenize) == ([], 0)


def test_nothing_forced_nothing_drafted(runtime, hf):
    matcher, _ = sequence(runtime, hf, r"[ab] read(s|ing)", "a read")  # "s" or "ing"
    assert forced_text(r"[ab] read(s|ing)", "a read") == ""
    assert forced_tail(matcher.matcher, None, runtime._tokenizer().tokenize_bytes) == ([], 0)


def test_a_rejected_draft_is_followed_by_the_forced_text(runtime, hf):
    pattern, output = HELD_BACK[1]
    matcher, _ = sequence(runtime, hf, pattern, output)
    tokenize = runtime._tokenizer().tokenize_bytes
    wrong = encode(hf, " cat")  # the grammar rejects it
    shaped = drafts_under_grammar(matcher, wrong, True, None, tokenize)
    assert shaped.token_ids == encode(hf, forced_text(pattern, output))
    assert shaped.num_forced == len(shaped.token_ids) and shaped.num_replaced == len(wrong)
    assert shaped.num_held_back >= 1
    assert drafts_under_grammar(matcher, wrong, True, None, None).token_ids == []  # before: cut only
    assert drafts_under_grammar(matcher, wrong, False, None, tokenize).token_ids == wrong  # drawn: kept
    # After drafts the grammar takes, the tail is appended (bounded by max_drafts).
    pattern, output = HELD_BACK[2]
    matcher, _ = sequence(runtime, hf, pattern, output, seq_id=2)
    first = encode(hf, " reads")
    shaped = drafts_under_grammar(matcher, first, True, None, tokenize)
    assert hf.decode(shaped.token_ids) == forced_text(pattern, output) and shaped.num_held_back == 1
    assert drafts_under_grammar(matcher, first, True, 2, tokenize).token_ids == shaped.token_ids[:2]


def test_a_sampled_requests_held_back_draft_gets_a_one_hot_row(runtime, hf):
    pattern, output = HELD_BACK[1]
    params = SamplingParams(temperature=1.0, structured_outputs={"regex": pattern})
    item = SamplingItem(FakeSeq(params, [], frozenset({hf.eos_token_id}), 5))
    result = StepResult(encode(hf, output), [])
    probs = torch.zeros(0, VOCAB)  # the drafter drew nothing
    out = runtime.grammar_drafts([item], [result], [probs], max_drafts=None)
    expected = encode(hf, forced_text(pattern, output))
    assert result.next_drafts == expected and runtime.timer.held_back_drafts >= 1
    assert torch.equal(out[0], torch.nn.functional.one_hot(torch.tensor(expected), VOCAB).float())


# ---- the engine ---------------------------------------------------------------------------
PROMPTS = ["The cat reads the book. The cat", "a b a b a b", "def add(x):\n    return"]
ENGINE_REGEX = r"(the|cat|a) read(s|ing)? the book,( token| tokens) (the|a) cat reads the book\."


def greedy_run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"regex": ENGINE_REGEX})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and regex.fullmatch(ENGINE_REGEX, out.outputs[0].text)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_output_with_held_back_drafts_equals_plain(qwen3_checkpoint, eagle3_head):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        plain = greedy_run(llm)
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2}
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec) as llm:
        tokens = greedy_run(llm)
        timer = llm.engine.runner.host_step.structured.timer
    assert tokens == plain
    assert timer.held_back_drafts > 0
