"""The model tree drafter (EAGLE3, a draft LM) runs only each depth's topk new frontier rows
(spec_decode/tree/proposer.py): the earlier frontier rows' K/V stay in the draft cache's scratch
slots and the tree mask's columns reach them (the last d * topk keys). Held against a re-running
drafter written here (depth d runs every frontier row so far, d * topk per sequence, under their
ancestor mask over those rows, and keeps the newest topk), on the same batches inside the engine:
the trees are equal (tokens, parents, depths, ancestor masks exactly; path scores to float32
rounding) in float32 on the Qwen3 and Llama-3.1 fixtures with EAGLE3 heads and on Qwen3 with
another LM as its draft model, the drafter runs topk rows per depth instead of d * topk, and greedy
output equals plain greedy output."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from fixtures.eagle3 import write_eagle3_head
from foretell import LLM, SamplingParams
from foretell.spec_decode.proposer import catch_up_metadata
from foretell.spec_decode.tree.build import TreeBuilder
from foretell.spec_decode.tree.proposer import ModelTreeDrafter
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
def targets(qwen3_checkpoint, eagle3_head, llama31_checkpoint, llama31_eagle3_head, qwen3_tied_checkpoint):
    return {"qwen3": (qwen3_checkpoint, eagle3_head), "llama31": (llama31_checkpoint, llama31_eagle3_head),
            "qwen3:draft_model": (qwen3_checkpoint, qwen3_tied_checkpoint)}  # another LM of the same tokenizer


def rerunning_draft(drafter: ModelTreeDrafter, batch, drafting: list[int]) -> DraftTree | None:
    """The reference: depth d re-runs all d * topk frontier rows so far at their scratch slots
    (base .. base + d * topk - 1, base the slot after the catch-up's last row) with their ancestor
    mask [d * topk, d * topk] over exactly those rows (a verify-shaped mask: W = the forward's own
    rows), and reads the newest topk rows."""
    proposer, shape = drafter.proposer, drafter.shape
    topk = shape.topk
    logits, state = proposer.catch_up(batch, drafting)
    if not drafting:
        return None
    n, device = len(drafting), logits.device
    builder = TreeBuilder(shape, torch.tensor([batch.next_token_ids[i] for i in drafting], device=device),
                          drafter.rank_logprobs)
    frontier, parent_slot = builder.add_depth(logits)
    roots = [batch.num_tokens_after_step(i) - 1 for i in drafting]
    bases = [r + 1 + proposer.row_offset for r in roots]  # EAGLE3: the root's own slot; a draft LM: the next
    table = batch.block_table[torch.tensor(drafting, device=device)]
    seqs = torch.arange(n, device=device).unsqueeze(1)
    eye = torch.eye(topk, dtype=torch.bool, device=device)
    tokens, states = [], []  # per depth: [n, topk] target ids, the rows' states (None: a draft LM's)
    parents = torch.arange(n, device=device).repeat_interleave(topk)  # depth 1: the root's state
    ancestors = eye.expand(n, topk, topk)  # [n, W, W]: every frontier row so far over every one
    for depth in range(1, shape.depth):
        tokens.append(proposer.to_target_ids(frontier))
        states.append(proposer.select_state_rows(state, parents))  # [n * topk, ...] or None
        if depth > 1:
            width = ancestors.shape[1]
            grown = torch.zeros(n, width + topk, width + topk, dtype=torch.bool, device=device)
            grown[:, :width, :width] = ancestors
            grown[:, width:, :width] = ancestors[seqs, width - topk + parent_slot]  # the parent's row
            grown[:, width:, width:] = eye
            ancestors = grown
        width = depth * topk
        positions = [min(r + d + proposer.row_offset, batch.max_model_len - 1)
                     for r in roots for d in range(1, depth + 1) for _ in range(topk)]
        metadata = catch_up_metadata(bases, [width] * n, table, batch.block_size, proposer.draft_block_size)
        metadata = replace(metadata, tree_mask=ancestors.reshape(n * width, width))
        every_state = None if states[0] is None else torch.cat([s.view(n, topk, -1) for s in states], 1).flatten(0, 1)
        out, new_state = proposer.tree_step(torch.cat(tokens, 1).flatten(), torch.tensor(positions, device=device),
                                            every_state, metadata)
        newest = (seqs * width + width - topk + torch.arange(topk, device=device)).flatten()
        frontier, parent_slot = builder.add_depth(out[newest].view(n, topk, -1))
        state = proposer.select_state_rows(new_state, newest)
        parents = (seqs * topk + parent_slot).flatten()
    tree = builder.finish()
    tree.tokens = torch.cat([tree.tokens[:, :1], proposer.to_target_ids(tree.tokens[:, 1:])], 1)
    return tree


class FrontierRows:
    """Counts the drafter's rows in the depth forwards (those with a tree mask; the catch-up has none)."""

    def __init__(self, proposer):
        self.step = proposer.tree_step
        self.rows = 0

    def __call__(self, tokens, positions, state, metadata):
        if metadata.tree_mask is not None:
            self.rows += tokens.shape[0]
        return self.step(tokens, positions, state, metadata)


@pytest.mark.parametrize("tree", [(3, 3, 8), (5, 4, 16)], ids=lambda t: ",".join(map(str, t)))
@pytest.mark.parametrize("family", ["qwen3", "llama31", "qwen3:draft_model"])
def test_frontier_drafter_equals_rerunning_drafter(targets, monkeypatch, family, tree):
    target, head = targets[family]
    method = "draft_model" if family.endswith(":draft_model") else "eagle3"
    plain = LLM(target, dtype="float32", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(), use_tqdm=False)]
    depth, topk, nodes = tree
    calls = []  # per draft call: (sequences drafting, frontier rows re-running, frontier rows now)
    mismatches = []  # (the engine turns an exception inside a step into failed requests: collect instead)
    original = ModelTreeDrafter.draft

    def checked_draft(self, batch, drafting):
        counter = FrontierRows(self.proposer)
        self.proposer.tree_step = counter
        try:
            expected = rerunning_draft(self, batch, drafting)  # (its catch-up writes what the next one does)
            rerun_rows, counter.rows = counter.rows, 0
            got = original(self, batch, drafting)
        finally:
            del self.proposer.tree_step  # the instance attribute: the class's method again
        if drafting:
            mismatches.extend(f for f in ("tokens", "parents", "depths", "ancestor_mask")
                              if not torch.equal(getattr(got, f), getattr(expected, f)))
            if not torch.allclose(got.scores, expected.scores, rtol=1e-5, atol=1e-5):
                mismatches.append(f"scores {got.scores.tolist()} != {expected.scores.tolist()}")
        calls.append((len(drafting), rerun_rows, counter.rows))
        return got

    monkeypatch.setattr(ModelTreeDrafter, "draft", checked_draft)
    spec = {"method": method, "model": head, "num_speculative_tokens": depth, "topk": topk, "num_draft_tokens": nodes}
    llm = LLM(target, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert not mismatches
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(n > 0 for n, _, _ in calls) and any(n > 1 for n, _, _ in calls)  # batches of trees drafted
    for n, rerun_rows, rows in calls:
        assert rows == n * topk * (depth - 1)  # topk new rows per depth
        assert rerun_rows == n * topk * depth * (depth - 1) // 2  # d * topk at depth d
    assert llm.get_stats()["num_drafts"] > 0
