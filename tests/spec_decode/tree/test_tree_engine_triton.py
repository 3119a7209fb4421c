"""Draft trees through the Triton attention backend (the GPU's kernels, run by Triton's interpreter
on the CPU): the tree verify's and the tree drafter's ancestor masks reach paged_attention_triton
(off CUDA RotaryEmbedding.fusable is false, so the masked forwards take the two launches here;
test_tree_engine_fused_rope.py forces the one-launch kernel with its mask), and greedy output equals
the plain engine's. Interpreted attention is slow (about 0.3 s a call): marked slow."""

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


def assert_greedy_trees_equal_plain(qwen3_checkpoint, eagle3_head, monkeypatch, max_tokens: int,
                                    after_plain=lambda: None) -> None:
    """Two prompts on the Triton backend, eager: a tree engine's greedy tokens equal the plain
    engine's, with accepted paths that move (after_plain runs between the two engines)."""
    from test_tree_engine import oracle_drafter

    prompts = ["The cat reads the book. The cat", "Question: what"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, attention_backend="triton", enforce_eager=True)
    outs = plain.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]
    after_plain()
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


@pytest.mark.slow
def test_greedy_trees_on_the_triton_backend_equal_plain(qwen3_checkpoint, eagle3_head, monkeypatch):
    assert_greedy_trees_equal_plain(qwen3_checkpoint, eagle3_head, monkeypatch, max_tokens=8)


@pytest.mark.slow
def test_graphed_tree_verify_pads_to_a_bucket_on_the_triton_backend(qwen3_checkpoint, eagle3_head):
    """A graph-safe backend without enforce_eager: whole-tree steps run on the verify graph's
    buffers and the drafter's expansion on its own (uncaptured on the CPU), 3 sequences padded to
    the bucket of 4 (padding rows write no KV, all-true mask rows); greedy output equals plain."""
    prompts = ["The cat reads the book. The cat", "Question: what", "def add(x):\n    return"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, attention_backend="triton", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2, "topk": 2, "num_draft_tokens": 4}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, attention_backend="triton",
              speculative_config=spec, max_num_seqs=4)
    step = llm.engine.runner.tree_step
    assert step.verify_graphs is not None and step.verify_graphs.buckets == [1, 2, 4]
    keys = []
    original = step.verify_graphs.run_tree

    def run_tree(batch, key):
        keys.append((batch.num_seqs, key))
        return original(batch, key)

    step.verify_graphs.run_tree = run_tree
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert (3, (4, 4)) in keys  # three trees padded to the bucket of four
    drafts = step.drafter.graphs  # the drafter's expansion on its buffers, padded the same way
    assert drafts.num_runs > 0 and drafts.bucket_for(3) == 4 and not drafts.reads_host_lengths
    assert drafts.num_caught_up > 0  # the catch-up padded to depth + 1 rows, padding sequences' slots -1
