"""Draft trees through the Triton attention backend (the GPU's kernels, run by Triton's interpreter
on the CPU): the tree verify's and the tree drafter's ancestor masks reach paged_attention_triton
(the fused rope + attend launch is skipped for masked forwards), and greedy output equals the plain
engine's. Interpreted attention is slow (about 0.3 s a call): marked slow."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams

if torch.cuda.is_available():
    pytest.skip("on a GPU the Triton path runs natively (tests/gpu)", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_backend")


@pytest.mark.slow
def test_greedy_trees_on_the_triton_backend_equal_plain(qwen3_checkpoint, eagle3_head, monkeypatch):
    from test_tree_engine import oracle_drafter

    prompts = ["The cat reads the book. The cat", "Question: what"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, attention_backend="triton", enforce_eager=True)
    outs = plain.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]
    # The target's own continuation hidden on each tree's last branch: accepted paths that move.
    moved = oracle_drafter(monkeypatch, {tuple(o.prompt_token_ids): [*o.prompt_token_ids, *o.outputs[0].token_ids]
                                         for o in outs})
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, attention_backend="triton", enforce_eager=True,
              speculative_config=spec)
    assert llm.engine.runner.tree_step is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.get_stats()["num_accepted_tokens"] >= 4 and any(node > depth for node, depth in moved)
