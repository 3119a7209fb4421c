"""CUDA graphs for the draft-tree verify forward (issue 28, docs/trees.md points 2-3).

A tree step where every sequence verifies a whole tree of T = num_draft_tokens nodes (T rows per
sequence: the root and its T - 1 drafts, in tree order) runs the target's forward as the replay of
a graph captured for (batch bucket, T). It is the chain's graph runner (runner/cuda_graph.py) with
one more static input: the ancestor mask `tree_mask` [bucket * T, T] bool, whose T columns address
each sequence's last T keys (its tree's nodes, written by this forward: ops/attention). The other
inputs are the chain's buffers, written the same way (one packed copy and one unpack,
runner/graph_inputs.py): input ids, positions (root + depth: RoPE sees the depth), slots (the
tree's nodes at consecutive slots), sequence lengths, query starts and block tables. Outputs are
the graph's static hidden states, the aux hidden states EAGLE3 reads, and every row's logits.

Padding sequences of a bucket (slot -1: they write no KV) get all-true mask rows. Batches of any
other shape (a tree cut near max_model_len, a prefill chunk or a tree-less decode row beside the
trees, more rows than MAX_TREE_GRAPH_ROWS) take the eager tree forward (runner/tree_step.py).

Off CUDA, with a graph-safe backend (Triton's interpreter in tests) or one that reads host lengths
(the torch reference, exact buckets), the same buffers run uncaptured, as the chain's do: the code
path the GPU replays is the one the CPU tests run.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.runner.cuda_graph import CapturedForward, CudaGraphRunner
from foretell.runner.input_batch import InputBatch

# The most verify rows a tree graph holds: its static logits are rows x vocab float32 (1 GiB at
# 2048 x 128256). Larger batches verify eagerly; their forward is compute-bound, not launch-bound.
MAX_TREE_GRAPH_ROWS = 2048


def tree_step_gemm_rows(max_num_seqs: int, depth: int, topk: int, num_draft_tokens: int) -> int:
    """The most rows one forward of a tree step puts through a linear layer at the largest batch:
    the verify's T = num_draft_tokens rows a sequence, the drafter's catch-up (the accepted path,
    padded to depth + 1 rows) and its expansion (topk frontier rows a depth). The few-row GEMMs
    (layers/small_m.py) are bound for this many rows before the capture, so the tree verify of a
    16-node tree at batch 1 takes the MMA, not cuBLAS (a plain runner binds batch x 2 rows)."""
    return max_num_seqs * max(num_draft_tokens, depth + 1, topk)


class TreeVerifyGraphs(CudaGraphRunner):
    """The target's tree verify forward per (bucket, num_nodes), with the tree mask as a static
    input buffer."""

    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        num_nodes: int,  # T: verify rows per sequence, the root counted
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        capture_graphs: bool = True,  # False: every replay runs the forward itself (eager)
        reads_host_lengths: bool = False,  # the attention backend reads host copies of the lengths
        max_rows: int = MAX_TREE_GRAPH_ROWS,
    ):
        if num_nodes < 2:
            raise ValueError(f"a tree verify graph needs num_nodes >= 2 (root + drafts), got {num_nodes}")
        max_seqs = min(max_num_seqs, max(1, max_rows // num_nodes))
        super().__init__(model, max_seqs, (num_nodes,), max_blocks_per_seq, block_size, max_model_len, device,
                         capture_graphs=capture_graphs, reads_host_lengths=reads_host_lengths)
        self.num_nodes = num_nodes
        # Each verify row's view of its sequence's last T keys; padding rows stay all-true.
        self.tree_mask = torch.ones(self.buckets[-1] * num_nodes, num_nodes, dtype=torch.bool,
                                    device=device)  # [max_rows, T]

    def _metadata(self, bucket: int, q: int) -> AttentionMetadata:
        return replace(super()._metadata(bucket, q), tree_mask=self.tree_mask[: bucket * q])

    def bucket_for(self, batch: InputBatch) -> tuple[int, int] | None:
        """(bucket, T) for a batch of whole trees only (T rows per sequence, mask T wide)."""
        mask = batch.attn_metadata.tree_mask
        if mask is None or mask.shape[1] != self.num_nodes:
            return None
        return super().bucket_for(batch)

    def run_tree(self, batch: InputBatch, key: tuple[int, int]) -> CapturedForward:
        """Copy the batch's tree mask [num_tokens, T] into the static buffer (padding rows all-true),
        then its other inputs, and replay; the graph's static outputs (rows past batch.num_tokens
        are padding)."""
        bucket, q = key
        rows = batch.num_tokens
        self.tree_mask[:rows].copy_(batch.attn_metadata.tree_mask, non_blocking=True)
        if rows < bucket * q:
            self.tree_mask[rows: bucket * q].fill_(True)
        return self.run(batch, key)
