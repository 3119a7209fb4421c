"""A speculative engine's k = 0 steps decoded plainly (decode_ahead.py's zero_drafts_only) on the
target's graph buffers of the Triton backend (Triton's interpreter on the CPU, uncaptured): the
GPU's case, where plain decode steps and padded verify steps share one CudaGraphRunner (its input
buffers, inputs_version, the block table advance_verify last uploaded). Adaptive EAGLE3 with
choices switching between 0 and drafting, queued ahead: greedy output equals plain greedy output.
Interpreted attention is slow: marked slow."""

from __future__ import annotations

import itertools

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.runner.decode_ahead import DecodeAhead
from foretell.spec_decode.adaptive import AdaptiveDraftLength

if torch.cuda.is_available():
    pytest.skip("on a GPU the Triton path runs natively (tests/gpu)", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
import_interpreted("foretell.ops.attention.triton_backend")


@pytest.mark.slow
def test_k_zero_steps_share_the_graph_buffers_with_padded_verifies(qwen3_checkpoint, eagle3_head, monkeypatch):
    prompts = ["The cat reads the book. The cat reads the book. The cat", "a b a b a b"]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    options = dict(dtype="float32", num_kv_blocks=64, attention_backend="triton", max_num_seqs=2,
                   async_scheduling="on", block_size=4)
    want = [o.outputs[0].token_ids for o in LLM(qwen3_checkpoint, **options).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": "auto"}
    llm = LLM(qwen3_checkpoint, speculative_config=spec, **options)
    runner = llm.engine.runner
    plain, verify = runner.pipeline.kinds  # plain decoding tried first
    assert isinstance(plain, DecodeAhead) and plain.zero_drafts_only and plain.graphs is verify.graphs is runner.graphs
    choices = itertools.cycle([0, 0, 0, 2, 0, 0, 0, 0, 3, 3, 0, 1])
    monkeypatch.setattr(AdaptiveDraftLength, "choose", lambda self, batch_size: next(choices))
    advanced = []
    advance = type(runner.graphs).advance_decode
    monkeypatch.setattr(type(runner.graphs), "advance_decode",
                        lambda self, *args: advanced.append(1) or advance(self, *args))
    verified, used = verify.num_steps, runner.pipeline.num_used
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert verify.num_steps > verified and advanced and runner.pipeline.num_used > used
    assert llm.get_stats()["num_drafts"] > 0
