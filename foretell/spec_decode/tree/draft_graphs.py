"""The tree drafter's expansion as one CUDA graph per batch bucket (issue 28, docs/trees.md point 3),
and the catch-up with it after a graphed verify.

run(): after the catch-up (the chain's, eager: its rows are each sequence's accepted path), everything
the tree draft does is device work of fixed shape (ModelTreeDrafter.expand): depth 1's top-k,
then per depth the head over bucket * topk frontier rows with their [topk, d * topk] ancestor
masks, the scratch slots and positions computed from the roots and the block table, and the
tree's choice (TreeBuilder: top-k, sorts, gathers; no host read). A graph per bucket captures all
of it; its static inputs are the catch-up's logits and h, the live count, the root tokens, the
roots' positions and the block tables, written before each replay; its outputs are the tree's
tensors, copied out after the replay (the runner keeps a sequence's tree until its verify, past
the next replay).

run_after_verify(): after a verify on its graph (whole trees), the catch-up too, in a second graph
per bucket: each sequence's accepted path padded to depth + 1 rows (ModelTreeDrafter.padded_catch_up),
its inputs the verify's device outputs (the paths' aux features gathered into a static buffer, the
path tokens, the accepted counts) and the verified roots' positions; the next roots and root tokens
follow on the device, so the whole draft phase is one replay launched before the step's host read.

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

from foretell.device_util import graph_capture
from foretell.models.base import side_by_side
from foretell.spec_decode.tree.proposer import ModelTreeDrafter
from foretell.spec_decode.tree.shape import DraftTree

TREE_FIELDS = ("tokens", "parents", "depths", "ancestor_mask", "scores")


@dataclass
class CapturedTreeDraft:
    graph: "torch.cuda.CUDAGraph"
    tree: DraftTree  # [bucket, T]: the graph's static outputs


class TreeDraftGraphs:
    def __init__(
        self,
        drafter: ModelTreeDrafter,
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
        head = drafter.proposer.head
        max_bucket = self.buckets[-1]
        self.logits = torch.zeros(max_bucket, head.draft_vocab_size, dtype=torch.float32, device=device)
        self.h = torch.zeros(max_bucket, head.hidden_size, dtype=head.norm.weight.dtype, device=device)
        # [live count | root tokens (max_bucket) | root positions (max_bucket)], one upload per step
        self.inputs = torch.zeros(1 + 2 * max_bucket, dtype=torch.int64, device=device)
        self.table = torch.zeros(max_bucket, max_blocks_per_seq, dtype=torch.int32, device=device)
        # The catch-up's inputs after a graphed verify (run_after_verify): each sequence's path rows'
        # aux features, padded to depth + 1 rows, its path tokens and accepted count. Zeros (finite,
        # valid ids) until a sequence fills them; the inputs' roots then hold the verified roots.
        rows_per_seq = drafter.shape.depth + 1
        fc = head.fc.weight  # [H, F]: the aux features side by side
        self.path_features = torch.zeros(max_bucket * rows_per_seq, fc.shape[1], dtype=fc.dtype, device=device)
        self.path_tokens = torch.zeros(max_bucket, rows_per_seq + 1, dtype=torch.int64, device=device)
        self.accepted = torch.zeros(max_bucket, dtype=torch.int64, device=device)
        self.graphs: dict[int, CapturedTreeDraft] = {}
        self.after_verify_graphs: dict[int, CapturedTreeDraft] = {}  # the catch-up and the expansion
        self.num_runs = 0  # drafts expanded here (replayed or uncaptured)
        self.num_caught_up = 0  # of them, drafts whose catch-up ran here too (run_after_verify)

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

    def _catch_up_and_expand(self, bucket: int, first_pos_host: list[int] | None = None) -> DraftTree:
        """The padded catch-up over the verified paths (ModelTreeDrafter.padded_catch_up), then the
        expansion from its last rows: the whole draft phase after a graphed verify."""
        max_bucket, rows = self.buckets[-1], bucket * (self.drafter.shape.depth + 1)
        first_pos = self.inputs[1 + max_bucket: 1 + max_bucket + bucket]
        live = torch.arange(bucket, device=self.device) < self.inputs[0]
        table, last_position = self.table[:bucket], self.max_model_len - 1
        logits, h, root_tokens, roots = self.drafter.padded_catch_up(
            self.path_features[:rows], self.path_tokens[:bucket], self.accepted[:bucket], first_pos, live, table,
            self.block_size, last_position, first_pos_host)
        roots_host = None
        if first_pos_host is not None:  # (exact buckets: the host knows the accepted counts too)
            roots_host = [p + a + 1 for p, a in zip(first_pos_host, self.accepted[:bucket].tolist())]
        return self.drafter.expand(logits, h, root_tokens, roots, table, self.block_size, last_position, live,
                                   roots_host)

    @torch.inference_mode()
    def capture(self) -> None:
        """Per bucket (largest first), after the target's graphs, in their pool: the expansion's
        graph and the catch-up-and-expansion's. On a failure (RuntimeError) none is kept and
        run() / run_after_verify() run uncaptured."""
        if not self.captures:
            return
        try:
            torch.cuda.synchronize(self.device)
            for bucket in reversed(self.buckets):
                kinds = ((self.graphs, self._expand), (self.after_verify_graphs, self._catch_up_and_expand))
                for graphs, body in kinds:
                    self.inputs.zero_()  # no live sequence: nothing written to the draft cache
                    for _ in range(2):  # compile Triton kernels and warm cuBLAS outside capture
                        body(bucket)
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with graph_capture(graph, pool=self.pool):
                        tree = body(bucket)
                    if self.pool is None:
                        self.pool = graph.pool()
                    graphs[bucket] = CapturedTreeDraft(graph, tree)
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            self.graphs.clear()
            self.after_verify_graphs.clear()
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
        self._upload(packed)
        self.logits[:n].copy_(logits)
        self.h[:n].copy_(h)
        self.table[:n, : table.shape[1]].copy_(table)
        self.num_runs += 1
        return self._replay_or_run(self.graphs, bucket, n,
                                   lambda: self._expand(bucket, roots if self.reads_host_lengths else None))

    def run_after_verify(
        self,
        aux: list[torch.Tensor],  # each [verify rows, Ht]: the target's aux hidden states of a whole-tree verify
        path_rows: torch.Tensor,  # [n, depth + 1] int64: each path row's verify row (padding rows: any row)
        path_tokens: torch.Tensor,  # [n, depth + 2] int64: the verified roots' tokens, then the output tokens
        accepted: torch.Tensor,  # [n] int64
        first_positions: list[int],  # [n] the verified roots' positions
        table: torch.Tensor,  # [n, width] int32, the target's block table rows
    ) -> DraftTree | None:
        """The catch-up over the verified paths and the next trees [n, T] (copies), from the verify's
        device outputs: one replay, no host read; None where the batch does not fit the buffers
        (the caller catches up and drafts the usual way)."""
        n = len(first_positions)
        bucket = self.bucket_for(n)
        features = side_by_side(aux)  # [verify rows, F] (a view when the aux states share one buffer)
        if (bucket is None or table.shape[1] > self.table.shape[1] or features.dtype != self.path_features.dtype
                or features.shape[1] != self.path_features.shape[1]
                or tuple(path_rows.shape) != (n, self.drafter.shape.depth + 1)):
            return None
        max_bucket = self.buckets[-1]
        packed = [n, *[0] * max_bucket, *first_positions, *[0] * (max_bucket - n)]
        self._upload(packed)
        torch.index_select(features, 0, path_rows.flatten(), out=self.path_features[: path_rows.numel()])
        self.path_tokens[:n].copy_(path_tokens)
        self.accepted[:n].copy_(accepted)
        self.table[:n, : table.shape[1]].copy_(table)
        self.num_runs += 1
        self.num_caught_up += 1
        return self._replay_or_run(
            self.after_verify_graphs, bucket, n,
            lambda: self._catch_up_and_expand(bucket, first_positions if self.reads_host_lengths else None))

    def _upload(self, packed: list[int]) -> None:
        """The step's host inputs into `inputs` (count, tokens or zeros, positions), in one copy."""
        host = torch.tensor(packed, dtype=torch.int64)
        self.inputs.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)

    @staticmethod
    def _replay_or_run(graphs: dict, bucket: int, n: int, run_eagerly) -> DraftTree:
        """The first n trees of the bucket's captured graph replayed (copies: the next replay
        rewrites its buffers), or of run_eagerly() where none was captured for it."""
        captured = graphs.get(bucket)
        if captured is None:
            tree = run_eagerly()
            return tree if bucket == n else _rows(tree, n, copy=False)
        captured.graph.replay()
        return _rows(captured.tree, n, copy=True)


def _rows(tree: DraftTree, n: int, copy: bool) -> DraftTree:
    """The first n sequences' trees; copies with copy (the graph's buffers are rewritten by the next replay)."""
    fields = [getattr(tree, f)[:n] for f in TREE_FIELDS]
    if copy:
        fields = [f.clone() for f in fields]
    return DraftTree(tree.shape, *fields)
