"""The verify rows' fill (foretell/structured/verify_rows.py) through StructuredOutputs' methods.

- rows filled ahead on the worker thread (fill_ahead) are the rows the step would fill itself (a
  fresh StructuredOutputs with nothing filled ahead is the reference), and are taken: for every
  sequence of the step, for a subset of the sequences filled ahead (offsets into the ahead rows);
- rows filled ahead for another step (other drafts, another output length) are not taken, and the
  step's own fill gives the right rows;
- no rows are filled ahead for a sequence whose step ended it (EOS) or emitted nothing, or that has
  no matcher yet; close() waits for the worker and drops the rows, and filling ahead works after.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.grammar_stubs import VOCAB, FakeSeq, SamplingItem, StepResult, encode
from foretell import SamplingParams
from foretell.structured.runtime import StructuredOutputs

PATTERN = r"[0-9]{2,3}-(ab|cd)x"


class VerifySeq(FakeSeq):
    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class VerifyItem(SamplingItem):
    """A ScheduledSequence that samples and verifies `drafts`."""

    def __init__(self, seq, drafts: list[int]):
        super().__init__(seq)
        self.draft_token_ids = drafts


def regex_seq(hf, output: str, seq_id: int) -> VerifySeq:
    params = SamplingParams(temperature=0, structured_outputs={"regex": PATTERN})
    return VerifySeq(params, encode(hf, output), frozenset({hf.eos_token_id}), seq_id)


def reference_rows(tokenizer_dir, seqs: list[VerifySeq], drafts: list[list[int]]) -> np.ndarray:
    """The rows a StructuredOutputs that filled nothing ahead gives for these sequences and drafts."""
    fresh = StructuredOutputs(tokenizer_dir, VOCAB)
    items = [VerifyItem(VerifySeq(s.sampling_params, list(s.output_token_ids), s.eos_token_ids, s.seq_id), d)
             for s, d in zip(seqs, drafts)]
    _, rows = fresh.fill_verify_rows(items, None, "cpu")
    return rows.copy()


def step_then_fill_ahead(runtime: StructuredOutputs, seqs: list[VerifySeq], new: list[list[int]],
                         drafts: list[list[int]]) -> None:
    """One step's end: each sequence emits new[i] and will verify drafts[i]; the sequences then
    take the emitted tokens, as the scheduler's postprocess does."""
    for seq in seqs:
        runtime.matcher_for(seq)  # fill_ahead walks sequences that have a matcher
    runtime.fill_ahead([SamplingItem(s) for s in seqs], [StepResult(n, d) for n, d in zip(new, drafts)])
    for seq, tokens in zip(seqs, new):
        seq.output_token_ids = seq.output_token_ids + tokens


def test_rows_filled_ahead_equal_the_steps_own_and_are_taken(runtime, hf, tokenizer_dir):
    seqs = [regex_seq(hf, "1", 0), regex_seq(hf, "", 1)]
    new = [encode(hf, "2"), encode(hf, "7")]
    drafts = [encode(hf, "-ab") + encode(hf, "q"), encode(hf, "8")]  # one rejected midway
    step_then_fill_ahead(runtime, seqs, new, drafts)
    items = [VerifyItem(s, d) for s, d in zip(seqs, drafts)]
    _, rows = runtime.fill_verify_rows(items, runtime.take_filled_ahead(), "cpu")
    assert runtime.timer.rows_filled_ahead == sum(len(d) + 1 for d in drafts)
    assert rows.shape == (sum(len(d) + 1 for d in drafts), runtime.num_words)
    assert (rows == reference_rows(tokenizer_dir, seqs, drafts)).all()


def test_a_subset_of_the_sequences_filled_ahead_takes_its_own_rows(runtime, hf, tokenizer_dir):
    seqs = [regex_seq(hf, "1", 0), regex_seq(hf, "", 1), regex_seq(hf, "44", 2)]
    new = [encode(hf, "2"), encode(hf, "3"), encode(hf, "4")]
    drafts = [encode(hf, "-cd"), encode(hf, "3"), encode(hf, "-ab") + encode(hf, "x")]
    step_then_fill_ahead(runtime, seqs, new, drafts)
    verified = [seqs[2], seqs[1]]  # out of the order they were filled in
    verified_drafts = [drafts[2], drafts[1]]
    _, rows = runtime.fill_verify_rows([VerifyItem(s, d) for s, d in zip(verified, verified_drafts)],
                                       runtime.take_filled_ahead(), "cpu")
    assert runtime.timer.rows_filled_ahead == len(drafts[2]) + 1 + len(drafts[1]) + 1
    assert (rows == reference_rows(tokenizer_dir, verified, verified_drafts)).all()


@pytest.mark.parametrize("change", ["other drafts", "other output length"])
def test_rows_filled_for_another_step_are_not_taken(runtime, hf, tokenizer_dir, change):
    seqs = [regex_seq(hf, "1", 0)]
    step_then_fill_ahead(runtime, seqs, [encode(hf, "2")], [encode(hf, "-ab")])
    drafts = encode(hf, "-cd") if change == "other drafts" else encode(hf, "-ab")
    if change == "other output length":
        seqs[0].output_token_ids = seqs[0].output_token_ids + encode(hf, "3")  # a token the fill never saw
    _, rows = runtime.fill_verify_rows([VerifyItem(seqs[0], drafts)], runtime.take_filled_ahead(), "cpu")
    assert runtime.timer.rows_filled_ahead == 0
    assert (rows == reference_rows(tokenizer_dir, seqs, [drafts])).all()


def test_no_rows_ahead_for_an_ended_empty_or_unmatched_step(runtime, hf):
    ended, empty = regex_seq(hf, "12-abx", 0), regex_seq(hf, "1", 1)
    step_then_fill_ahead(runtime, [ended, empty], [[hf.eos_token_id], []], [[], encode(hf, "2")])
    assert runtime.take_filled_ahead() is None
    never_matched = regex_seq(hf, "1", 2)  # no matcher_for() yet: fill_ahead skips it
    runtime.fill_ahead([SamplingItem(never_matched)], [StepResult(encode(hf, "2"), [])])
    assert runtime.take_filled_ahead() is None


def test_close_drops_the_rows_and_filling_ahead_works_after(runtime, hf, tokenizer_dir):
    seqs = [regex_seq(hf, "1", 0)]
    step_then_fill_ahead(runtime, seqs, [encode(hf, "2")], [encode(hf, "-ab")])
    runtime.close()
    assert runtime.take_filled_ahead() is None
    step_then_fill_ahead(runtime, seqs, [encode(hf, "-")], [encode(hf, "cd")])
    drafts = encode(hf, "cd")
    _, rows = runtime.fill_verify_rows([VerifyItem(seqs[0], drafts)], runtime.take_filled_ahead(), "cpu")
    assert runtime.timer.rows_filled_ahead == len(drafts) + 1
    assert (rows == reference_rows(tokenizer_dir, seqs, [drafts])).all()
    runtime.close()
