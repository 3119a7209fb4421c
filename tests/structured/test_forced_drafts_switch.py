"""The switch for grammar-forced drafts (speculative_config structured_forced_drafts, CLI
--structured-forced-drafts on|off; issue 27).

- Config and CLI: on by default, `off` reaches SpeculativeConfig as False, anything but a bool
  is a clear error naming the field.
- Off, StructuredOutputs.grammar_drafts gives the form before forced drafts: a greedy or
  deterministic request's drafts cut at the first one the grammar rejects (checked against an
  independent reference: Python's `regex` partial matching over the decoded drafts), nothing
  appended or replaced, drawn drafts and their probabilities untouched, the matcher unmoved.
- The engine, greedy, on the Qwen3 fixture with eagle3 and n-gram: the output equals plain
  greedy with the grammar both on and off; off, no verify passes k and no forced draft is
  counted, on, forced drafts are counted and, on n-gram's host step, some verify passes k
  (eagle3's padded step holds k: structured/padded_verify.py).
"""

from __future__ import annotations

import argparse
import contextlib

import pytest
import regex
import torch

from fixtures.grammar_stubs import VOCAB, FakeSeq, SamplingItem, StepResult, encode
from fixtures.padded_step import host_step_for_host_drafters
from foretell import LLM, SamplingParams
from foretell.cli_args import add_engine_args, speculative_config_from_args
from foretell.config import SpeculativeConfig
from foretell.structured.runtime import StructuredOutputs

PATTERN = r"[0-9]{1,2}-abcab-(x|yy)ba\."
# Long fixed stretches between short free parts: forced runs longer than k = 2.
ENGINE_REGEX = r"(the|cat|[0-9]{1,2}) reads the book, (the|a) cat reads the book\."
PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b"]


# ---- config and CLI -----------------------------------------------------------------------
def parse(argv: list[str]) -> dict | None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    return speculative_config_from_args(parser.parse_args(["--method", "ngram", *argv]))


def test_the_switch_is_on_by_default_and_off_from_the_cli():
    assert SpeculativeConfig(method="ngram").structured_forced_drafts is True
    assert "structured_forced_drafts" not in parse([])
    assert parse(["--structured-forced-drafts", "off"])["structured_forced_drafts"] is False
    assert parse(["--structured-forced-drafts", "on"])["structured_forced_drafts"] is True
    assert SpeculativeConfig.from_any(parse(["--structured-forced-drafts", "off"])).structured_forced_drafts is False
    with pytest.raises(SystemExit):
        parse(["--structured-forced-drafts", "maybe"])
    with pytest.raises(ValueError, match="structured_forced_drafts must be true or false, got 'off'"):
        SpeculativeConfig(method="ngram", structured_forced_drafts="off")


# ---- grammar_drafts with the switch off ---------------------------------------------------
def reference_cut(hf, output: list[int], drafts: list[int]) -> list[int]:
    """The longest prefix of drafts whose text, after the output's, can still grow into a match."""
    kept = []
    for token in drafts:
        if not regex.fullmatch(PATTERN, hf.decode(output + kept + [token]), partial=True):
            break
        kept.append(token)
    return kept


def shaped(runtime, hf, output: str, drafts: list[int], temperature: float = 0.0, probs=None, seq_id: int = 1):
    params = SamplingParams(temperature=temperature, structured_outputs={"regex": PATTERN})
    seq = FakeSeq(params, [], frozenset({hf.eos_token_id}), seq_id)
    result = StepResult(encode(hf, output), list(drafts))
    out = runtime.grammar_drafts([SamplingItem(seq)], [result], [probs], max_drafts=None)
    return result.next_drafts, out[0], runtime.matchers[seq_id]


@pytest.mark.parametrize("output, drafts", [
    ("1", "2-ab"),  # all taken; "cab-" is forced after them (appended when on)
    ("12-abcab-yy", "xx"),  # "ba." forced; "x" rejected (replaced when on)
    ("12-abcab-", "zz"),  # rejected at once
    ("12-", "abcab-yyba.q"),  # taken up to the pattern's end
])
def test_off_cuts_only_as_the_reference_says(tokenizer_dir, hf, output, drafts):
    off = StructuredOutputs(tokenizer_dir, VOCAB, forced_drafts=False)
    on = StructuredOutputs(tokenizer_dir, VOCAB)
    tokens = encode(hf, drafts)
    cut, _, matcher = shaped(off, hf, output, tokens)
    assert cut == reference_cut(hf, encode(hf, output), tokens)
    assert matcher.num_consumed == len(encode(hf, output))
    assert matcher.allowed_prefix(tokens) == len(cut)  # the matcher is where the output left it
    with_forced, _, _ = shaped(on, hf, output, tokens)
    assert off.timer.forced_drafts == 0 and off.timer.replaced_drafts == 0
    if on.timer.forced_drafts:  # on: the forced run changed the drafts, off: it did not
        assert with_forced != cut


def test_off_leaves_drawn_drafts_and_their_probabilities(tokenizer_dir, hf):
    off = StructuredOutputs(tokenizer_dir, VOCAB, forced_drafts=False)
    wrong = encode(hf, "xx")
    probs = torch.softmax(torch.randn(len(wrong), VOCAB), dim=-1)  # [k, vocab]
    drafts, out_probs, _ = shaped(off, hf, "12-abcab-yy", wrong, temperature=1.0, probs=probs)
    assert drafts == wrong and out_probs is probs
    # Sampled with deterministic drafts (no q): cut, as greedy.
    drafts, out_probs, _ = shaped(off, hf, "12-abcab-yy", wrong, temperature=1.0, seq_id=2)
    assert drafts == [] and out_probs is None


# ---- the engine ---------------------------------------------------------------------------
def greedy_run(llm: LLM) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": ENGINE_REGEX})
    before = llm.get_stats()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and regex.fullmatch(ENGINE_REGEX, out.outputs[0].text)
    after = llm.get_stats()
    old, new = before.get("accepted_per_position", []), after.get("accepted_per_position", [])
    positions = [a - b for a, b in zip(new, old)] + new[len(old):]
    return [o.outputs[0].token_ids for o in outs], {
        "positions": positions, "drafts": after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)}


@pytest.fixture(scope="module")
def plain_tokens(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        return greedy_run(llm)[0]


@pytest.mark.parametrize("method, host_step", [("eagle3", False), ("ngram", False), ("ngram", True)])
def test_greedy_output_equals_plain_with_the_switch_on_and_off(method, host_step, request, qwen3_checkpoint,
                                                               plain_tokens):
    """On the padded step (every drafter; its verify length caps the drafts at k) and on the host
    step (a host drafter there: tensor parallelism's and hybrid drafters' path)."""
    k = 2
    for forced in (True, False):
        config = {"method": method, "num_speculative_tokens": k, "structured_forced_drafts": forced}
        if method == "eagle3":
            config["model"] = request.getfixturevalue("eagle3_head")
        else:
            config["prompt_lookup_min"] = 1
        with host_step_for_host_drafters() if host_step else contextlib.nullcontext():
            llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=config)
        with llm:
            tokens, stats = greedy_run(llm)
            timer = llm.engine.runner.host_step.structured.timer
        assert tokens == plain_tokens, f"forced drafts {'on' if forced else 'off'}"
        assert stats["drafts"] > 0
        if forced:
            assert timer.forced_drafts > 0
            assert any(stats["positions"][k:]) is host_step  # some verify past k: the host step's
        else:
            assert timer.forced_drafts == 0 and timer.replaced_drafts == 0
            assert len(stats["positions"]) == k  # no verify past k
