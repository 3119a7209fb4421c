"""The grammar matcher of a speculative step (foretell/structured/): the masks of a verify step's
rows against an independent reference (Python's `regex` package, partial matching over decoded
token texts), the walk through drafts and its rollback, cutting drafts, EOS at the grammar's end,
the device bitmask op against a plain loop, and the validation of bad parameters."""

from __future__ import annotations

import numpy as np
import pytest
import regex
import torch

from fixtures.grammar_stubs import FakeSeq, SamplingItem, StepResult
from foretell import SamplingParams
from foretell.structured.bitmask import apply_token_bitmask, num_mask_words, unpack_bitmask
from foretell.structured.params import StructuredOutputsParams
from foretell.structured.runtime import StructuredOutputs

PATTERN = r"[0-9]{2,3}-(ab|cd)x"


@pytest.fixture(scope="module")
def runtime(tokenizer_dir):
    return StructuredOutputs(tokenizer_dir, 512)  # the fixture checkpoints' padded vocabulary


def allowed_set(row: np.ndarray) -> set[int]:
    return set(np.nonzero(unpack_bitmask(torch.from_numpy(row[None]), 512)[0].numpy())[0].tolist())


def reference_allowed(hf, prefix: str, eos: int) -> set[int]:
    """Tokens t whose text keeps prefix + text(t) a prefix of a full match; EOS where prefix matches."""
    allowed = set()
    for t in range(len(hf)):
        if t in hf.all_special_ids:
            continue
        text = hf.decode([t])
        if not text or "\ufffd" in text:
            continue
        if regex.fullmatch(PATTERN, prefix + text, partial=True):
            allowed.add(t)
    if regex.fullmatch(PATTERN, prefix):
        allowed.add(eos)
    return allowed


def test_verify_masks_match_the_reference_and_roll_back(runtime, hf):
    eos = hf.eos_token_id
    params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    output = hf.encode("4", add_special_tokens=False)
    seq = FakeSeq(params, output, frozenset({eos}))
    matcher = runtime.matcher_for(seq)
    drafts = hf.encode("2-ab", add_special_tokens=False) + hf.encode("q", add_special_tokens=False)  # 'q' breaks it
    out = np.zeros((len(drafts) + 1, runtime.num_words), dtype=np.int32)
    before = np.zeros((1, runtime.num_words), dtype=np.int32)
    matcher.fill_mask(before[0])
    taken = matcher.verify_masks(drafts, out)
    assert taken == len(drafts) - 1
    text = "4"
    for j in range(taken + 1):
        assert allowed_set(out[j]) == reference_allowed(hf, text, eos), (j, text)
        if j < len(drafts):
            text += hf.decode([drafts[j]])
    assert (out[taken + 1:] == out[taken]).all()  # the rows past the rejected draft repeat its mask
    after = np.zeros_like(before)
    matcher.fill_mask(after[0])
    assert (after == before).all()  # rolled back to the output so far
    runtime.forget(seq.seq_id)


def test_complete_grammar_allows_only_eos_and_drafts_are_cut(runtime, hf):
    eos = hf.eos_token_id
    params = SamplingParams(temperature=0, structured_outputs={"choice": ["yes", "no"]})
    seq = FakeSeq(params, hf.encode("ye", add_special_tokens=False), frozenset({eos, 3}), seq_id=7)
    matcher = runtime.matcher_for(seq)
    s = hf.encode("s", add_special_tokens=False)
    assert matcher.allowed_prefix(s + [eos, 5]) == len(s) + 1  # EOS where the grammar may end; nothing after
    assert matcher.allowed_prefix(hf.encode("x", add_special_tokens=False) + s) == 0
    matcher.advance(seq.output_token_ids + s)
    row = np.zeros(runtime.num_words, dtype=np.int32)
    matcher.fill_mask(row)
    assert allowed_set(row) == {eos, 3}  # every EOS id of the sequence, nothing else
    runtime.forget(seq.seq_id)


def test_drafts_are_cut_only_where_exact(runtime, hf):
    """Greedy requests and sampled requests with one-hot drafts lose the drafts from the first one
    the grammar rejects; a sampled draft from a distribution stays (rejection sampling needs it).
    Drafts the grammar takes to a point where it forces "x" get that token appended
    (tests/structured/test_forced_drafts.py holds the forced drafts)."""
    good = hf.encode("2-", add_special_tokens=False)  # "12-": "ab" or "cd" next, nothing forced
    bad = hf.encode("zz", add_special_tokens=False)
    items, results, probs = [], [], []
    for seq_id, (temperature, has_probs) in enumerate([(0.0, True), (1.0, False), (1.0, True)], start=20):
        params = SamplingParams(temperature=temperature, structured_outputs={"regex": PATTERN})
        items.append(SamplingItem(FakeSeq(params, [], frozenset({hf.eos_token_id}), seq_id=seq_id)))
        results.append(StepResult(hf.encode("1", add_special_tokens=False), good + bad))
        probs.append(torch.zeros(len(good + bad), 512) if has_probs else None)
    kept_probs = runtime.grammar_drafts(items, results, probs, max_drafts=None)
    assert [r.next_drafts for r in results] == [good, good, good + bad]
    assert kept_probs == probs  # nothing appended to a sampled request's drafts
    # After "12-ab" the grammar forces "x": a rejected draft there is replaced by it where exact,
    # and drafts the grammar takes to there get it appended.
    ab, x = hf.encode("2-ab", add_special_tokens=False), hf.encode("x", add_special_tokens=False)
    for result in results:
        result.next_drafts = ab + bad
    runtime.grammar_drafts(items, results, probs, max_drafts=None)
    assert [r.next_drafts for r in results] == [ab + x, ab + x, ab + bad]
    for result in results:
        result.next_drafts = ab
    runtime.grammar_drafts(items, results, probs, max_drafts=None)
    assert [r.next_drafts for r in results] == [ab + x] * 3
    for item in items:
        runtime.forget(item.seq.seq_id)


def test_replayed_output_rebuilds_the_state(runtime, hf):
    """After forget() (a preemption), the next step replays the output into a fresh matcher."""
    params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    output = hf.encode("12-c", add_special_tokens=False)
    seq = FakeSeq(params, output, frozenset({hf.eos_token_id}), seq_id=3)
    first = np.zeros(runtime.num_words, dtype=np.int32)
    runtime.matcher_for(seq).fill_mask(first)
    runtime.forget(3)
    again = np.zeros_like(first)
    runtime.matcher_for(seq).fill_mask(again)
    assert (first == again).all() and allowed_set(first) == reference_allowed(hf, "12-c", hf.eos_token_id)
    runtime.forget(3)


def test_mask_logits_masks_only_structured_rows(runtime, hf):
    class Item:
        def __init__(self, seq, drafts):
            self.seq, self.draft_token_ids = seq, drafts

    constrained = FakeSeq(SamplingParams(temperature=0, structured_outputs={"regex": PATTERN}), [],
                          frozenset({hf.eos_token_id}), seq_id=11)
    free = FakeSeq(SamplingParams(temperature=0), [], frozenset(), seq_id=12)
    items = [Item(free, [5]), Item(constrained, hf.encode("1", add_special_tokens=False))]
    logits = torch.randn(4, 512)
    masked = runtime.mask_logits(logits, items, copy=True)
    assert torch.equal(masked[:2], logits[:2])  # the unconstrained sequence's rows
    digits = {t for t in range(len(hf)) if hf.decode([t]).isdigit() and len(hf.decode([t])) <= 3}
    finite = set(torch.isfinite(masked[2]).nonzero().flatten().tolist())
    assert finite and finite <= digits
    runtime.forget(11)


def test_bitmask_op_equals_a_plain_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, num_mask_words(vocab)), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    rows = [4, 0, 2]
    for m, r in enumerate(rows):
        for t in range(vocab):
            word = int(bitmask[m, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_token_bitmask(logits, torch.tensor(rows), bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("value, message", [
    ({"regex": "[a-"}, "structured_outputs.regex is not valid"),
    ({"json": {"type": "objekt"}}, "structured_outputs.json is not valid"),
    ({"json": "{not json"}, "its text does not parse"),
    ({"choice": []}, "non-empty list"),
    ({"grammar": "start: ("}, "structured_outputs.grammar is not valid"),
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"jsn": {}}, "unknown keys ['jsn']"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be True or False"),
    ("a string", "got str"),
])
def test_bad_structured_outputs_are_refused(value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(structured_outputs=value)
    assert message in str(error.value)


def test_each_kind_compiles():
    for value in ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, {"json_object": True},
                  {"regex": "a+"}, {"choice": ["x", "y"]}, {"grammar": 'root ::= "yes" | "no"'},
                  {"grammar": 'start: "a" | "b"'}):
        params = StructuredOutputsParams.from_value(value)
        assert params.compiled and params.kind == next(iter(value))


def test_rows_other_controls_empty_fall_back_to_the_grammar():
    """A row whose allowed tokens all got -inf (or NaN, +inf) from other controls takes the
    fallback logits under the mask: the token drawn always satisfies the grammar."""
    vocab = 64
    raw = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    controlled = raw.clone()
    controlled[0, :] = float("-inf")  # an allow list without any grammar token
    controlled[1, 5] = float("inf")
    controlled[1, 6] = float("nan")
    bitmask = torch.zeros(3, num_mask_words(vocab), dtype=torch.int32)
    bitmask[:, 0] = (1 << 5) | (1 << 6) | (1 << 9)  # tokens 5, 6, 9 allowed
    apply_token_bitmask(controlled, torch.tensor([0, 1, 2]), bitmask, fallback=raw)
    allowed = [5, 6, 9]
    assert torch.equal(controlled[0, allowed], raw[0, allowed])  # row 0: the fallback under the mask
    assert controlled[1, 5] == torch.finfo(torch.float32).max and controlled[1, 6] == float("-inf")
    assert torch.equal(controlled[2, allowed], raw[2, allowed])
    others = [t for t in range(vocab) if t not in allowed]
    assert torch.isneginf(controlled[:, others]).all()


def test_structured_with_conflicting_allow_list_still_matches(qwen3_checkpoint, hf):
    from foretell import LLM

    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[hf.encode("!", add_special_tokens=False)[0]],
                                structured_outputs={"regex": PATTERN})
        out = llm.generate(["The cat"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and regex.fullmatch(PATTERN, out.text)
