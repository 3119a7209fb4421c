"""Draft trees from a host drafter (suffix decoding with topk > 1): the drafter's trees, built on the
host from token lists (spec_decode/suffix_draft_tree.py), as the DraftTree the tree step verifies
(runner/tree_step.py).

Every sequence of the step goes through the drafter once (its gate times every step, its states
take every step's tokens); the sequences the tree step lets draft and whose tree is not empty get
one. A tree smaller than the step's T = num_draft_tokens nodes is padded to T with copies of its
last node (a leaf: best-first order puts a node's children after it): a copy has the same token,
parent and depth, so greedy verification accepts it exactly when it accepts the original (the same
path and tokens), and multi-draft rejection sampling rejects it after the original (the residual
left by rejecting a token gives that token no mass): the output is the target's either way. Whole
trees of T nodes let a batch of drafting sequences verify on the tree step's (bucket, T) graph.

The tree goes to the device in one upload (tokens, parents, depths) plus the ancestor mask built
there from the parents (tree/shape.py); scores are the log path probabilities of the empirical
model (root 0).
"""

from __future__ import annotations

import math

import torch

from foretell.device_util import to_device
from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.tree.shape import DraftTree, TreeShape, ancestor_mask_from_parents


class HostTreeDrafter:
    graphs = None  # no device graphs: the tree step drafts after its host read

    def __init__(self, proposer, shape: TreeShape, device: torch.device):
        self.proposer = proposer  # a SuffixProposer whose settings draft trees (topk > 1)
        self.shape = shape
        self.device = device

    def draft(self, batch: DraftBatch, drafting: list[int]) -> tuple[list[int], DraftTree | None, list[list[int]]]:
        """The drafter over the whole batch; trees for those of `drafting` (indices into the batch)
        that drafted any: (their indices, their trees [m, T], each one's tokens then depths as host
        lists [m][2T]: nothing to read back), ([], None, []) when none did."""
        drafts = self.proposer.propose_drafts(batch)
        picked = [i for i in drafting if drafts[i].token_ids]
        if not picked:
            return [], None, []
        num_nodes = self.shape.num_draft_tokens
        tokens, parents, depths, scores = [], [], [], []
        for i in picked:
            tree = drafts[i]
            pad = num_nodes - 1 - len(tree.token_ids)
            if pad < 0:
                raise RuntimeError(f"a drafted tree of {len(tree.token_ids)} nodes does not fit "
                                   f"num_draft_tokens={num_nodes} (the root included)")
            tokens += [batch.next_token_ids[i], *tree.token_ids, *[tree.token_ids[-1]] * pad]
            parents += [-1, *tree.parents, *[tree.parents[-1]] * pad]
            depths += [0, *tree.depths, *[tree.depths[-1]] * pad]
            scores += [0.0, *[math.log(p) for p in tree.probs], *[math.log(tree.probs[-1])] * pad]
        m = len(picked)
        rows = [slice(j * num_nodes, (j + 1) * num_nodes) for j in range(m)]
        host = [tokens[r] + depths[r] for r in rows]
        ints = to_device(tokens + parents + depths, torch.int64, self.device).view(3, m, num_nodes)
        parent_rows = ints[1]
        tree = DraftTree(self.shape, ints[0], parent_rows, ints[2],
                         ancestor_mask_from_parents(parent_rows, self.shape.depth),
                         to_device(scores, torch.float32, self.device).view(m, num_nodes))
        return picked, tree, host
