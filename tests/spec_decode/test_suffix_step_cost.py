"""What a suffix-decoding step costs the host on the GPU's path, measured on the CPU (issue 29).

bench/stub_target.stubbed_target gives a host drafter the pipeline graph_setup.build_step_pipeline
builds for it on a GPU (uncaptured graph buffers of host_draft_verify_lens, steps queued ahead), so
bench/host_overhead's probe runs a suffix step's host path on the CPU. Checked here:
  - with the stub's constant tokens the drafter drafts and its verifies take the padded step;
    everything the probe set is put back afterwards and the engine's output is unchanged;
  - with fresh tokens (no text repeats: GSM8K's path at its worst) a step without drafts IS a plain
    decode step queued ahead: the same device ops, syncs and uploads per step as plain decoding;
  - the stub's tokens (constant / fresh) and its bad input.
"""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.bench.host_overhead import count_step_work, measure_host_overhead
from foretell.bench.stub_target import _StubTarget
from foretell.runner.decode_ahead import DecodeAhead
from foretell.runner.graphed_verify import GraphedVerify

PROMPTS = [[(97 * i + 13 * j) % 400 + 1 for j in range(12 + 3 * i)] for i in range(3)]  # no 4-gram twice
# The gate's bar fixed: these tests check the step's mechanics, not the "auto" bar, which learns from
# wall time (a loaded machine can raise it to k and stop the stub's drafts: CI at a65ee1d).
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_accepted_tokens": 1.0}


def engine(folder, spec=None) -> LLM:
    return LLM(folder, device="cpu", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
               speculative_config=spec, log_stats_interval_s=0, async_scheduling="on")


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)]


def test_stubbed_suffix_drafts_on_the_padded_step_and_puts_everything_back(qwen3_checkpoint):
    llm = engine(qwen3_checkpoint, SUFFIX)
    expected = generate(llm)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    pipeline, graphs, keep_rows = runner.pipeline, runner.graphs, scheduler.keep_draft_rows
    assert GraphedVerify in [type(kind) for kind in pipeline.kinds]  # the CPU: the padded step, uncaptured
    result = measure_host_overhead(llm, PROMPTS, greedy(), stub_forward=True)
    # The stub's constant token: drafts of it are accepted once the match forms.
    assert result.tokens_per_step > 1.5
    assert runner.pipeline is pipeline and runner.graphs is graphs and scheduler.keep_draft_rows == keep_rows
    assert not {"forward", "compute_logits", "compute_greedy_tokens"} & set(vars(runner.model))
    assert generate(llm) == expected
    # The stubbed pipeline is the GPU's: a plain decode step first, then the padded verify.
    from foretell.bench.stub_target import _host_drafter_pipeline

    built, buffers = _host_drafter_pipeline(runner, 4)
    assert [type(kind) for kind in built.kinds] == [DecodeAhead, GraphedVerify] and built.queue_ahead
    assert buffers.query_lens == (1, 2, 3, 4) and not buffers.captures
    assert _host_drafter_pipeline(engine(qwen3_checkpoint).engine.runner, 4) is None  # no drafter


def test_a_step_without_drafts_costs_a_plain_decode_step(qwen3_checkpoint):
    """Fresh tokens: the suffix drafter never matches, and each step makes the device calls of a
    plain decode step queued ahead (graph_setup puts DecodeAhead before the padded verify)."""
    plain = count_step_work(engine(qwen3_checkpoint), PROMPTS, greedy(), stub_forward=True, stub_tokens="fresh")
    llm = engine(qwen3_checkpoint, SUFFIX)
    suffix = count_step_work(llm, PROMPTS, greedy(), stub_forward=True, stub_tokens="fresh")
    assert plain["steps"] == suffix["steps"] == 11 * len(PROMPTS)  # one token a step, prefills apart
    # (a step or two apart where the larger lookahead lets a step be queued that plain decoding's
    # block reservation launches from host inputs, or the other way round)
    for key in ("syncs_per_step", "device_ops_per_step", "uploads_per_step"):
        assert suffix[key] == pytest.approx(plain[key], abs=0.1), key
    assert plain["syncs_per_step"] == 1.0 and plain["uploads_per_step"] == 0.0
    assert llm.get_stats()["num_drafts"] == 0
    # What the drafter adds on the host: its glue's Python calls per step stay few.
    assert suffix["python_calls_per_step"] - plain["python_calls_per_step"] <= 30


def test_stub_tokens():
    hidden_size, vocab = 8, 50
    constant = _StubTarget(hidden_size, 2, vocab, token=7)
    ids, positions = torch.tensor([3, 4, 5]), torch.tensor([10, 11, 12])
    hidden, aux = constant.forward(ids, positions, None)
    assert hidden.shape == (3, hidden_size) and len(aux) == 2
    assert constant.compute_logits(hidden).argmax(-1).tolist() == [7, 7, 7]
    fresh = _StubTarget(hidden_size, 0, vocab, token=7, stub_tokens="fresh")
    first = fresh.compute_greedy_tokens(fresh.forward(ids, positions, None)[0])
    second = fresh.compute_greedy_tokens(fresh.forward(ids, positions, None)[0])
    assert first.tolist() != second.tolist()  # salted by the forward's count: never the same text
    assert ((0 <= first) & (first < vocab)).all()
    logits = fresh.compute_logits(fresh.forward(ids, positions, None)[0])
    assert logits.shape == (3, vocab) and (logits.sum(-1) == 1).all()
    with pytest.raises(ValueError, match="stub_tokens"):
        _StubTarget(hidden_size, 0, vocab, token=7, stub_tokens="random")
    with pytest.raises(ValueError, match="hidden_size"):
        _StubTarget(2, 0, vocab, token=7)
