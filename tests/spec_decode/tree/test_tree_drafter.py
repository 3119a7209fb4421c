"""The EAGLE3 tree drafter runs only each depth's topk new frontier rows (spec_decode/tree/proposer.py):
the earlier frontier rows' K/V stay in the draft cache's scratch slots and the tree mask's columns
reach them (the last d * topk keys). Held against a re-running drafter written here (depth d runs
every frontier row so far, d * topk per sequence, under their ancestor mask over those rows, and
keeps the newest topk), on the same batches inside the engine: the trees are equal (tokens, parents,
depths, ancestor masks exactly; path scores to float32 rounding) in float32 on the Qwen3 and
Llama-3.1 fixtures, the head runs topk rows per depth instead of d * topk, and greedy output equals
plain greedy output."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from fixtures.eagle3 import write_eagle3_head
from foretell import LLM, SamplingParams
from foretell.spec_decode.proposer import catch_up_metadata
from foretell.spec_decode.tree.build import TreeBuilder
from foretell.spec_decode.tree.proposer import Eagle3TreeDrafter
from foretell.spec_decode.tree.shape import DraftTree

PROMPTS = [
    "The cat reads the book. The cat reads the book. The cat",
    "Question: what is 3 plus 7? Answer:",
]
MAX_TOKENS = 12


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama31_eagle3_head(checkpoint_root, llama31_checkpoint) -> str:
    folder = os.path.join(checkpoint_root, "eagle3_llama31_tree")  # the same head as test_tree_engine's
    if not os.path.isdir(folder):
        write_eagle3_head(folder, llama31_checkpoint, "specforge", seed=5)
    return folder


@pytest.fixture(scope="module")
def targets(qwen3_checkpoint, eagle3_head, llama31_checkpoint, llama31_eagle3_head):
    return {"qwen3": (qwen3_checkpoint, eagle3_head), "llama31": (llama31_checkpoint, llama31_eagle3_head)}


def rerunning_draft(drafter: Eagle3TreeDrafter, batch, drafting: list[int]) -> DraftTree | None:
    """The reference: depth d re-runs all d * topk frontier rows so far at their scratch slots
    (root .. root + d * topk - 1) with their ancestor mask [d * topk, d * topk] over exactly those
    rows (a verify-shaped mask: W = the forward's own rows), and reads the newest topk rows."""
    eagle, shape = drafter.eagle, drafter.shape
    topk = shape.topk
    logits, h = eagle.catch_up(batch, drafting)
    if not drafting:
        return None
    n, device = len(drafting), h.device
    builder = TreeBuilder(shape, torch.tensor([batch.next_token_ids[i] for i in drafting], device=device),
                          drafter.rank_logprobs)
    frontier, parent_slot = builder.add_depth(logits)
    roots = [batch.num_tokens_after_step(i) - 1 for i in drafting]
    table = batch.block_table[torch.tensor(drafting, device=device)]
    seqs = torch.arange(n, device=device).unsqueeze(1)
    eye = torch.eye(topk, dtype=torch.bool, device=device)
    tokens, states = [], []
    parent_h = h.unsqueeze(1).expand(n, topk, h.shape[-1])
    ancestors = eye.expand(n, topk, topk)  # [n, W, W]: every frontier row so far over every one
    for depth in range(1, shape.depth):
        tokens.append(eagle.to_target_ids(frontier))
        states.append(parent_h[seqs, parent_slot])
        if depth > 1:
            width = ancestors.shape[1]
            grown = torch.zeros(n, width + topk, width + topk, dtype=torch.bool, device=device)
            grown[:, :width, :width] = ancestors
            grown[:, width:, :width] = ancestors[seqs, width - topk + parent_slot]  # the parent's row
            grown[:, width:, width:] = eye
            ancestors = grown
        width = depth * topk
        positions = [min(r + d, batch.max_model_len - 1) for r in roots for d in range(1, depth + 1) for _ in range(topk)]
        metadata = catch_up_metadata(roots, [width] * n, table, batch.block_size, eagle.draft_block_size)
        metadata = replace(metadata, tree_mask=ancestors.reshape(n * width, width))
        newest = (seqs * width + width - topk + torch.arange(topk, device=device)).flatten()
        out, new_h = eagle.head.step(torch.cat(tokens, 1).flatten(), torch.tensor(positions, device=device),
                                     torch.cat(states, 1).flatten(0, 1), metadata, newest)
        frontier, parent_slot = builder.add_depth(out.view(n, topk, -1))
        parent_h = new_h.view(n, topk, -1)
    tree = builder.finish()
    tree.tokens = torch.cat([tree.tokens[:, :1], eagle.to_target_ids(tree.tokens[:, 1:])], 1)
    return tree


class FrontierRows:
    """Counts the head rows of the depth forwards (those with a tree mask; the catch-up has none)."""

    def __init__(self, head):
        self.step = head.step
        self.rows = 0

    def __call__(self, tokens, positions, states, metadata, *rest, **kwargs):
        if metadata.tree_mask is not None:
            self.rows += tokens.shape[0]
        return self.step(tokens, positions, states, metadata, *rest, **kwargs)


@pytest.mark.parametrize("tree", [(3, 3, 8), (5, 4, 16)], ids=lambda t: ",".join(map(str, t)))
@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_frontier_drafter_equals_rerunning_drafter(targets, monkeypatch, family, tree):
    target, head = targets[family]
    plain = LLM(target, dtype="float32", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(), use_tqdm=False)]
    depth, topk, nodes = tree
    calls = []  # per draft call: (sequences drafting, frontier rows re-running, frontier rows now)
    mismatches = []  # (the engine turns an exception inside a step into failed requests: collect instead)
    original = Eagle3TreeDrafter.draft

    def checked_draft(self, batch, drafting):
        counter = FrontierRows(self.eagle.head)
        self.eagle.head.step = counter
        try:
            expected = rerunning_draft(self, batch, drafting)  # (its catch-up writes what the next one does)
            rerun_rows, counter.rows = counter.rows, 0
            got = original(self, batch, drafting)
        finally:
            del self.eagle.head.step  # the instance attribute: the class's method again
        if drafting:
            mismatches.extend(f for f in ("tokens", "parents", "depths", "ancestor_mask")
                              if not torch.equal(getattr(got, f), getattr(expected, f)))
            if not torch.allclose(got.scores, expected.scores, rtol=1e-5, atol=1e-5):
                mismatches.append(f"scores {got.scores.tolist()} != {expected.scores.tolist()}")
        calls.append((len(drafting), rerun_rows, counter.rows))
        return got

    monkeypatch.setattr(Eagle3TreeDrafter, "draft", checked_draft)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": depth, "topk": topk, "num_draft_tokens": nodes}
    llm = LLM(target, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert not mismatches
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(n > 0 for n, _, _ in calls) and any(n > 1 for n, _, _ in calls)  # batches of trees drafted
    for n, rerun_rows, rows in calls:
        assert rows == n * topk * (depth - 1)  # topk new rows per depth
        assert rerun_rows == n * topk * depth * (depth - 1) // 2  # d * topk at depth d
    assert llm.get_stats()["num_drafts"] > 0
