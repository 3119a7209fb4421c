"""The tree drafter's expansion as one CUDA graph per batch bucket (issue 28, docs/trees.md point 3).

After the catch-up (the chain's, eager: its rows are each sequence's accepted path), everything
the tree draft does is device work of fixed shape (Eagle3TreeDrafter.expand): depth 1's top-k,
then per depth the head over bucket * topk frontier rows with their [topk, d * topk] ancestor
masks, the scratch slots and positions computed from the roots and the block table, and the
tree's choice (TreeBuilder: top-k, sorts, gathers; no host read). A graph per bucket captures all
of it; its static inputs are the catch-up's logits and h, the live count, the root tokens, the
roots' positions and the block tables, written before each replay; its outputs are the tree's
tensors, copied out after the replay (the runner keeps a sequence's tree until its verify, past
the next replay).

Padding sequences of a bucket write no KV (slot -1; their rows read stale, finite inputs). Off
CUDA, with --enforce-eager or a capture that failed, the same buffers run uncaptured; with an
attention backend that reads host lengths (the torch reference) the bucket is the exact batch and
the roots' host copy gives the lengths. A batch larger than the largest bucket, or inputs of
another dtype than the buffers, drafts eagerly (run() returns None).

The target's side arrives as arguments (spec_decode never imports runner): the batch buckets,
the block table width and the graph pool of the target's graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.spec_decode.tree.proposer import Eagle3TreeDrafter
from foretell.spec_decode.tree.shape import DraftTree

TREE_FIELDS = ("tokens", "parents", "depths", "ancestor_mask", "scores")


@dataclass
class CapturedTreeDraft:
    graph: "torch.cuda.CUDAGraph"
    tree: DraftTree  # [bucket, T]: the graph's static outputs


class TreeDraftGraphs:
    def __init__(
        self,
        drafter: Eagle3TreeDrafter,
        buckets: list[int],  # batch buckets, ascending (the target's)
        max_blocks_per_seq: int,
        block_size: int,  # the target's
        max_model_len: int,
        device: torch.device,
        capture_graphs: bool = True,  # False: every run() executes the expansion itself
        reads_host_lengths: bool = False,  # the head's attention backend reads host copies of the lengths
        pool=None,  # the CUDA graph memory pool to share (the target's)
    ):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"tree draft graph buckets must be ascending positive sizes, got {buckets}")
        self.drafter = drafter
        self.buckets = list(buckets)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture_graphs = capture_graphs and not reads_host_lengths
        self.reads_host_lengths = reads_host_lengths
        self.pool = pool
        head = drafter.eagle.head
        max_bucket = self.buckets[-1]
        self.logits = torch.zeros(max_bucket, head.draft_vocab_size, dtype=torch.float32, device=device)
        self.h = torch.zeros(max_bucket, head.hidden_size, dtype=head.norm.weight.dtype, device=device)
        # [live count | root tokens (max_bucket) | root positions (max_bucket)], one upload per step
        self.inputs = torch.zeros(1 + 2 * max_bucket, dtype=torch.int64, device=device)
        self.table = torch.zeros(max_bucket, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, CapturedTreeDraft] = {}
        self.num_runs = 0  # drafts expanded here (replayed or uncaptured)

    @property
    def captures(self) -> bool:
        return self.device.type == "cuda" and self.capture_graphs

    def _expand(self, bucket: int, roots_host: list[int] | None = None) -> DraftTree:
        max_bucket = self.buckets[-1]
        root_tokens = self.inputs[1: 1 + bucket]
        roots = self.inputs[1 + max_bucket: 1 + max_bucket + bucket]
        live = torch.arange(bucket, device=self.device) < self.inputs[0]
        return self.drafter.expand(self.logits[:bucket], self.h[:bucket], root_tokens, roots, self.table[:bucket],
                                   self.block_size, self.max_model_len - 1, live, roots_host)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket (largest first), after the target's graphs, in their pool. On a
        failure (RuntimeError) none is kept and run() runs the expansion uncaptured."""
        if not self.captures:
            return
        try:
            torch.cuda.synchronize(self.device)
            for bucket in reversed(self.buckets):
                self.inputs.zero_()  # no live sequence: nothing written to the draft cache
                for _ in range(2):  # compile Triton kernels and warm cuBLAS outside capture
                    self._expand(bucket)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    tree = self._expand(bucket)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bucket] = CapturedTreeDraft(graph, tree)
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            self.graphs.clear()
            raise

    def bucket_for(self, num_seqs: int) -> int | None:
        if num_seqs > self.buckets[-1]:
            return None
        if self.reads_host_lengths:  # no padding sequences: such a backend reads every row's length
            return num_seqs
        return next(b for b in self.buckets if b >= num_seqs)

    def run(
        self,
        logits: torch.Tensor,  # [n, draft_vocab] float32
        h: torch.Tensor,  # [n, H]
        root_tokens: list[int],  # [n] target ids
        roots: list[int],  # [n] root positions
        table: torch.Tensor,  # [n, width] int32, the target's block table rows
    ) -> DraftTree | None:
        """The trees [n, T] of the n drafting sequences (copies, not the graph's buffers), or None
        where this batch does not fit the buffers (the caller expands eagerly)."""
        n = len(roots)
        bucket = self.bucket_for(n)
        if (bucket is None or table.shape[1] > self.table.shape[1] or logits.dtype != self.logits.dtype
                or tuple(logits.shape[1:]) != tuple(self.logits.shape[1:]) or h.dtype != self.h.dtype
                or tuple(h.shape[1:]) != tuple(self.h.shape[1:])):
            return None
        max_bucket = self.buckets[-1]
        packed = [n, *root_tokens, *[0] * (max_bucket - n), *roots, *[0] * (max_bucket - n)]
        host = torch.tensor(packed, dtype=torch.int64)
        self.inputs.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        self.logits[:n].copy_(logits)
        self.h[:n].copy_(h)
        self.table[:n, : table.shape[1]].copy_(table)
        self.num_runs += 1
        captured = self.graphs.get(bucket)
        if captured is None:
            tree = self._expand(bucket, roots if self.reads_host_lengths else None)
            return tree if bucket == n else _rows(tree, n, copy=False)
        captured.graph.replay()
        return _rows(captured.tree, n, copy=True)


def _rows(tree: DraftTree, n: int, copy: bool) -> DraftTree:
    """The first n sequences' trees; copies with copy (the graph's buffers are rewritten by the next replay)."""
    fields = [getattr(tree, f)[:n] for f in TREE_FIELDS]
    if copy:
        fields = [f.clone() for f in fields]
    return DraftTree(tree.shape, *fields)
