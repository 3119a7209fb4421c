"""Acceptance under a grammar is what the drafter earns, nothing lost to the grammar machinery
(issue 27's acceptance bar), and the next step's masks filled ahead on the worker thread.

- A grammar the target's unconstrained greedy output already satisfies (always-true): the same
  tokens, and the same draft and accepted counts, as without one (the no-op logit_bias takes the
  same host step) for eagle3, a draft LM and n-gram. A drafter whose later draft positions were
  masked with the step's starting grammar state, or a verify row masked with the wrong state,
  would lose drafts here.
- A grammar that forces one fixed string: the model drafters' drafts are the forced tokens
  (llguidance's fast-forward tokens), k a verify on the padded step, all accepted.
- StructuredOutputs.fill_ahead: the rows the next step verifies are filled on the worker thread
  (rows_filled_ahead counts them) and the output is the same.
- The device op's in-place path (rows as one slice) against a plain loop.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.defaults import member_path
from foretell.structured.bitmask import apply_token_bitmask, contiguous_rows, num_mask_words

PROMPTS = [
    "The cat reads the book. The cat reads the book. The cat",
    "def add(x):\n    return x + 1\ndef add(x):\n    return",
]
ALWAYS_TRUE = r"(.|\n)*"
FIXED = "the cat reads 12 books, then the cat reads 3 more."


def spec_config(method: str) -> dict:
    """The shipped default family's drafters (trained: a random head accepts nothing)."""
    config = {"method": method, "num_speculative_tokens": 3}
    if method in ("eagle3", "draft_model"):
        config["model"] = member_path(method)
    else:
        config["prompt_lookup_min"] = 1
    return config


needs_default_models = pytest.mark.skipif(not os.path.isdir(member_path("target")), reason="no default models")


def counted_run(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], int, int]:
    before = llm.get_stats()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = llm.get_stats()
    return ([o.outputs[0].token_ids for o in outs], after["num_draft_tokens"] - before["num_draft_tokens"],
            after["num_accepted_tokens"] - before["num_accepted_tokens"])


@needs_default_models
@pytest.mark.parametrize("method", ["eagle3", "draft_model", "ngram"])
def test_a_grammar_the_output_satisfies_keeps_acceptance(method):
    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(member_path("target"), dtype="float32", num_kv_blocks=128, speculative_config=spec_config(method)) as llm:
        plain = counted_run(llm, SamplingParams(**base, logit_bias={0: 0.0}))  # the same host step
        grammar = counted_run(llm, SamplingParams(**base, structured_outputs={"regex": ALWAYS_TRUE}))
        filled_ahead = llm.engine.runner.host_step.structured.timer.rows_filled_ahead
    assert plain[1] > 0 and plain[2] > 0
    assert grammar == plain
    assert filled_ahead > 0  # the verify rows came from the worker thread


@needs_default_models
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_a_grammar_forcing_a_string_accepts_every_draft(method):
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"regex": FIXED.replace(".", r"\.")})
    with LLM(member_path("target"), dtype="float32", num_kv_blocks=128, speculative_config=spec_config(method)) as llm:
        before = llm.get_stats()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        after = llm.get_stats()
    assert [o.outputs[0].text for o in outs] == [FIXED] * len(PROMPTS)
    steps = after["num_drafts"] - before["num_drafts"]
    drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    # After the first token the rest of the string is forced: each verify holds k = 3 drafts, the
    # drafter's replaced by the grammar's forced run where they differ (structured/forced_drafts.py;
    # the padded step that verifies a model drafter's grammar requests holds k: padded_verify.py),
    # and takes them all; a last step may verify the drafter's EOS guess. A drafter drafting
    # against the grammar state of the step's start would get one right token a step.
    num_tokens = len(outs[0].outputs[0].token_ids)
    assert math.ceil((num_tokens - 1) / 4) > 2
    assert steps <= math.ceil((num_tokens - 1) / 4) * len(PROMPTS)
    assert drafts >= num_tokens - 2 and drafts - accepted <= len(PROMPTS)


def test_plain_decoding_fills_the_next_rows_ahead(qwen3_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": r"[a-z ]{4,40}\."})
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        structured = llm.engine.runner.host_step.structured
        assert structured.timer.rows_filled_ahead > 0
        structured.fill_ahead = lambda scheduled, results: None  # every step fills its own rows
        second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert first == second


@pytest.mark.parametrize("rows", [[1, 2, 3], [0], [2, 0]])
def test_bitmask_op_on_a_slice_equals_a_plain_loop(rows):
    gen = torch.Generator().manual_seed(1)
    vocab = 77
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), num_mask_words(vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, vocab, generator=gen)
    expected = logits.clone()
    for m, r in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[m, t // 32]) & 0xFFFFFFFF) >> (t % 32) & 1:
                expected[r, t] = float("-inf")
    index = contiguous_rows(rows)
    assert (index is None) == (rows == [2, 0])
    apply_token_bitmask(logits, index if index is not None else torch.tensor(rows), bitmask)
    assert torch.equal(logits, expected)
