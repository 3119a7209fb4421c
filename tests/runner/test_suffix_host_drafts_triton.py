"""A host drafter (suffix) on the target's graph buffers of the Triton backend (run by Triton's
interpreter on the CPU, uncaptured, with the GPU's verify lengths, K = 3: 1, 2, 3, 4): its verifies
take the padded step (runner/host_drafts.py), a batch of fewer drafts padded to the shortest length
that holds its longest draft, and greedy output equals plain greedy output. Interpreted attention
is slow: marked slow."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams

if torch.cuda.is_available():
    pytest.skip("on a GPU the Triton path runs natively (tests/gpu)", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
import_interpreted("foretell.ops.attention.triton_backend")


@pytest.mark.slow
def test_suffix_greedy_equals_plain_on_graph_buffers(qwen3_checkpoint):
    prompts = ["The cat reads the book. The cat reads the book. The cat", "a b a b a b"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    options = dict(dtype="float32", num_kv_blocks=64, attention_backend="triton", max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in LLM(qwen3_checkpoint, **options).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 6,
            "suffix_decoding_min_match_length": 2}
    llm = LLM(qwen3_checkpoint, speculative_config=spec, **options)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.draft_graphs.verify_lens == (1, 2, 3, 4)
    assert runner.pipeline.kinds[0].num_steps > 0 and llm.get_stats()["num_accepted_tokens"] > 0
