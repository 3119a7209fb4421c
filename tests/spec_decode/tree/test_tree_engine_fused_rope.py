"""Draft trees through the one-launch RoPE + KV write + attention kernel (triton_rope_paged.py with
tree_mask) end to end, in Triton's interpreter on the CPU: RotaryEmbedding.fusable is forced true
(on a GPU it is), so every forward_rotary of the Triton backend, the tree verify's and the tree
drafter's masked rows included, takes rope_attend. Greedy output equals the plain engine's on the
same path. Interpreted attention is slow: marked slow."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("on a GPU the fused path runs natively (tests/gpu)", allow_module_level=True)

from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.pointwise.triton_kernels")
import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
import_interpreted("foretell.ops.attention.triton_rope_kv")
fused = import_interpreted("foretell.ops.attention.triton_rope_paged")
import_interpreted("foretell.ops.attention.triton_backend")


@pytest.mark.slow
def test_greedy_trees_through_the_fused_rope_attention_equal_plain(qwen3_checkpoint, eagle3_head, monkeypatch):
    from foretell.layers.rotary import RotaryEmbedding
    from test_tree_engine_triton import assert_greedy_trees_equal_plain

    monkeypatch.setattr(RotaryEmbedding, "fusable",
                        lambda self, positions, query, key: query.dim() == 3 and key.dim() == 3
                        and query.dtype == key.dtype)
    masked_rows = []  # rows of each fused launch that carried a tree mask
    kernel = fused.rope_paged_attention_triton

    def spy(*args, tree_mask=None, **kwargs):
        if tree_mask is not None:
            masked_rows.append(args[1].shape[0])
        return kernel(*args, tree_mask=tree_mask, **kwargs)

    monkeypatch.setattr(fused, "rope_paged_attention_triton", spy)

    def no_mask_in_plain():
        assert not masked_rows

    assert_greedy_trees_equal_plain(qwen3_checkpoint, eagle3_head, monkeypatch, 6, after_plain=no_mask_in_plain)
    # two sequences' 6-node tree verifies in one launch, and their drafter's frontiers of topk 2
    assert 2 * 6 in masked_rows and 2 * 2 in masked_rows
