"""The graphed verify path (static buffers, device-side catch-up and chained draft steps) at
max_model_len, run without capture on the CPU through Triton's interpreter, on checkpoints whose
rotary tables end at the limit (test_context_limit.short_context): requests run to exactly
max_model_len with the plain engine's tokens, and the graphed draft loop places chained steps
whose drafts would sit past the limit at max_model_len - 1 (ops/step dispatch.catch_up_inputs)."""

from __future__ import annotations

import os

import pytest
import torch

from foretell import LLM

if torch.cuda.is_available():
    pytest.skip("on a GPU the graph path runs captured (tests/gpu)", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401
from test_context_limit import prompt, short_context, to_limit, token_ids  # noqa: E402

import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
import_interpreted("foretell.ops.attention.triton_backend")

LIMIT = 24  # short: the interpreter runs every kernel in Python
# Every draft is accepted (a self-draft; simulated acceptance for the EAGLE3 head), so after the
# prefill each sequence's first verify is graphed and its chained steps would pass the limit:
# EAGLE3 from a first verify at N = 20 or 21, a draft LM at N = 19 or 20 (N = prompt + 1; a
# draft LM's catch-up feeds one row past its verify's, so at N = 21 it drafts eagerly).
LENGTHS = {"qwen3": (15, 17, 18), "eagle3": (16, 19, 20)}


@pytest.fixture(scope="module")
def folders(checkpoint_root, qwen3_checkpoint, eagle3_head):
    return {name: short_context(folder, os.path.join(checkpoint_root, f"short{LIMIT}_{name}"), LIMIT)
            for name, folder in (("qwen3", qwen3_checkpoint), ("eagle3", eagle3_head))}


@pytest.mark.slow
@pytest.mark.parametrize("draft,async_scheduling", [("qwen3", "on"), ("eagle3", "off")])
def test_graphed_verify_runs_to_exactly_max_model_len(folders, draft, async_scheduling, monkeypatch):
    from foretell.spec_decode import draft_graph

    placed_past = []  # per graphed draft loop: the furthest chained position it would have used

    def spy(original):
        def spying(*args):
            unbounded = original(*args[:-1], 10**9)
            live = int(args[4])  # num_live
            placed_past.append(int(unbounded.chained.positions[:, :live].max()) if live else -1)
            return original(*args)
        return spying

    # the device's form and the CPU's (from host ints: spec_decode/catch_up_host.py), whichever runs
    for name in ("catch_up_inputs", "catch_up_inputs_host"):
        monkeypatch.setattr(draft_graph, name, spy(getattr(draft_graph, name)))
    if draft == "qwen3":
        spec = {"method": "draft_model", "model": folders["qwen3"], "num_speculative_tokens": 3}
    else:
        spec = {"method": "eagle3", "model": folders["eagle3"], "num_speculative_tokens": 3,
                "simulate_acceptance": {"rates": [1.0, 1.0, 1.0]}}
    llm = LLM(folders["qwen3"], dtype="float32", num_kv_blocks=64, max_num_seqs=4, attention_backend="triton",
              async_scheduling=async_scheduling, speculative_config=spec)
    assert llm.engine.runner.draft_graphs is not None and llm.engine.max_model_len == LIMIT
    lengths = LENGTHS[draft]
    outs = llm.generate([prompt(n, 1) for n in lengths], to_limit(), use_tqdm=False)  # one batch
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [LIMIT - n for n in lengths]
    if draft == "qwen3":  # real acceptance: the target's own tokens
        plain = LLM(folders["qwen3"], dtype="float32", num_kv_blocks=64)
        assert token_ids(outs) == [token_ids(plain.generate([prompt(n, 1)], to_limit(), use_tqdm=False))[0]
                                   for n in lengths]
    # The graphed loop ran where its chained steps would have passed the limit (and the rotary
    # tables, which end there): they ran at LIMIT - 1 instead.
    assert max(placed_past) >= LIMIT, placed_past
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
