"""Adaptive speculation's k = 0 steps that run no drafter (speculative_config
adaptive_skip_catch_up, issue 28): with an EAGLE3 head a step whose next step drafts nothing skips
the head's catch-up, on the padded step (draft_graph.DraftGraphRunner.skips) and on the host step
(HostStep.runs_no_drafter); the head's KV cache keeps holes there.

Checked on the CPU (fp32, the eager padded step: the same code as the captured one), with the
policy's choices forced: greedy output equals plain greedy decoding with the skip on and off,
queued ahead or not, padded or host step; the drafter runs no forward on a k = 0 step with the skip
on and one per step with it off; a draft LM never skips; the holes are the cache's zeros as
allocated and every draft logit read over them is finite; the option's plumbing (config, CLI).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fixtures.padded_step import PROMPTS, fp32_engine, padded_kind
from foretell import SamplingParams
from foretell.cli import build_parser
from foretell.cli_args import speculative_config_from_args
from foretell.config import SpeculativeConfig
from foretell.spec_decode.adaptive import AdaptiveDraftLength
from foretell.spec_decode.hybrid import HybridProposer
from foretell.spec_decode.mtp import MTPProposer


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def adaptive_engine(checkpoint: str, drafter: dict, skip: bool, mode: str = "off", **options):
    spec = {**drafter, "num_speculative_tokens": 3, "adaptive": True, "adaptive_skip_catch_up": skip}
    return fp32_engine(checkpoint, async_scheduling=mode, speculative_config=spec, **options)


def force_choices(monkeypatch, cycle: list[int]) -> None:
    """The policy chooses the draft counts of `cycle` in turn, exploration and all bypassed."""
    choices = itertools.cycle(cycle)
    monkeypatch.setattr(AdaptiveDraftLength, "choose", lambda self, batch_size: next(choices))


def count_decode_catch_ups(monkeypatch, proposer) -> list[int]:
    """[catch-ups over decode rows only]: every padded catch-up, and the host catch-ups whose
    sequences all have one row (k = 0: a prefill's catch-up has its prompt's rows)."""
    count = [0]
    padded, host = proposer.padded_catch_up, proposer.catch_up

    def counted_padded(*args, **kwargs):
        count[0] += 1
        return padded(*args, **kwargs)

    def counted_host(batch, *args, **kwargs):
        count[0] += all(v == 1 for v in batch.num_valid_rows)
        return host(batch, *args, **kwargs)

    monkeypatch.setattr(proposer, "padded_catch_up", counted_padded)
    monkeypatch.setattr(proposer, "catch_up", counted_host)
    return count


@pytest.fixture(scope="module")
def plain_outputs(qwen3_checkpoint) -> list[list[int]]:
    llm = fp32_engine(qwen3_checkpoint)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_greedy_output_with_skipped_catch_ups_equals_plain(qwen3_checkpoint, eagle3_head, plain_outputs,
                                                           monkeypatch, skip, mode):
    """Stretches of k = 0 between drafting steps (the first drafts after a stretch read holes):
    greedy output equals plain, queued ahead or not."""
    force_choices(monkeypatch, [0, 0, 0, 0, 3, 0, 0, 2, 1, 0, 3, 3])
    llm = adaptive_engine(qwen3_checkpoint, {"method": "eagle3", "model": eagle3_head}, skip, mode)
    assert llm.engine.runner.draft_graphs.skip_catch_up is skip and llm.engine.runner.host_step.skip_catch_up is skip
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]
    assert got == plain_outputs
    if mode == "on":  # steps queued ahead were used, k = 0 ones among them
        assert llm.engine.runner.pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("padded", [True, False])
def test_a_k_zero_step_runs_no_drafter_with_the_skip_on(qwen3_checkpoint, eagle3_head, plain_outputs,
                                                         monkeypatch, padded):
    """k = 0 on every step: with the skip on the head runs no forward after the prefills (padded
    step or host step); with it off, one catch-up per decode step."""
    force_choices(monkeypatch, [0])
    counts, steps = {}, {}
    for skip in (True, False):
        llm = adaptive_engine(qwen3_checkpoint, {"method": "eagle3", "model": eagle3_head}, skip)
        kind = padded_kind(llm)
        kind.enabled = padded  # off: every batch takes the host step
        count = count_decode_catch_ups(monkeypatch, llm.engine.runner.proposer)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24), use_tqdm=False)]
        assert got == plain_outputs
        counts[skip], steps[skip] = count[0], kind.num_steps
    assert counts[True] == 0
    if padded:  # one loop per padded step (nothing queued ahead: async off)
        assert counts[False] == steps[False] > 15
    else:  # the 4 sequences decode together once the last prompt is in
        assert steps[False] == 0 and counts[False] >= 20


def test_a_draft_lm_never_skips(qwen3_checkpoint, monkeypatch):
    """A draft LM's KV cache is its only context: it catches up on every k = 0 step, and its
    padded loop keeps the m = 0 loop."""
    force_choices(monkeypatch, [0])
    llm = adaptive_engine(qwen3_checkpoint, {"method": "draft_model", "model": qwen3_checkpoint}, True)
    runner = llm.engine.runner
    assert not runner.proposer.capabilities.catch_up_skippable
    assert not runner.draft_graphs.skip_catch_up and not runner.host_step.skip_catch_up
    assert (1, 0) in runner.draft_graphs.loop_keys()
    count = count_decode_catch_ups(monkeypatch, runner.proposer)
    kind = padded_kind(llm)
    llm.generate(PROMPTS[:2], greedy(12), use_tqdm=False)
    assert count[0] == kind.num_steps > 10


def test_mtp_may_skip_and_the_hybrid_never_does():
    """MTP reads the target's hidden states like EAGLE3; suffix + a model proposes every step."""
    mtp = MTPProposer.__new__(MTPProposer)  # capabilities read class attributes only
    assert mtp.capabilities.catch_up_skippable
    hybrid = HybridProposer.__new__(HybridProposer)
    hybrid.model = mtp
    assert not hybrid.capabilities.catch_up_skippable


def test_holes_are_the_caches_zeros_and_read_finite(qwen3_checkpoint, eagle3_head, monkeypatch):
    """One sequence, k = 0 for its first 10 steps then 3: the head's cache holds the prompt's rows
    and nothing for the skipped positions (zeros, as allocated); the catch-up after the stretch
    attends over those holes and its logits are finite."""
    prompt = {"prompt_token_ids": [(7 * j) % 200 + 1 for j in range(11)]}
    choices = iter([0] * 10)
    monkeypatch.setattr(AdaptiveDraftLength, "choose", lambda self, batch_size: next(choices, 3))
    llm = adaptive_engine(qwen3_checkpoint, {"method": "eagle3", "model": eagle3_head}, True)
    runner = llm.engine.runner
    cache = runner.draft_kv_cache.tensors  # each [2, blocks, block_size, kv_heads, head_dim]
    assert all(not t.any() for t in cache)  # allocated as zeros
    written = []  # per padded catch-up: the cache's slots written before it
    padded = runner.proposer.padded_catch_up

    def checked(*args, **kwargs):
        written.append(int(cache[0][0].flatten(0, 1).ne(0).flatten(1).any(1).sum()))  # keys [slots, ...]
        logits, state = padded(*args, **kwargs)
        assert torch.isfinite(logits).all()
        return logits, state

    monkeypatch.setattr(runner.proposer, "padded_catch_up", checked)
    llm.generate([prompt], greedy(20), use_tqdm=False)
    # Before the first catch-up after the stretch: the prompt's 11 rows only (the skipped ones are holes).
    assert written and written[0] == 11
    assert all(torch.isfinite(t).all() for t in cache)


def test_the_option_in_config_and_cli():
    assert SpeculativeConfig(method="mtp").adaptive_skip_catch_up is True
    with pytest.raises(ValueError, match="adaptive_skip_catch_up must be true or false"):
        SpeculativeConfig(method="mtp", adaptive_skip_catch_up="no")
    parser = build_parser()
    for flag, want in ((["--adaptive-skip-catch-up", "off"], False), (["--adaptive-skip-catch-up", "on"], True),
                       ([], None)):
        args = parser.parse_args(["generate", "--method", "mtp", "--model", "m", "--prompt", "p", *flag])
        assert speculative_config_from_args(args).get("adaptive_skip_catch_up") == want
