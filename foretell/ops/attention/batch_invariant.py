"""Attention of the batch-invariant mode (ModelConfig.batch_invariant, issue 23), in torch: each query
row attends alone to exactly its own context, so its result depends on that row's query, its
context and the context's length, and on nothing else of the step.

TorchAttentionBackend (reference.py) attends a sequence's rows together: the scores of a prefill
chunk or a verify are one batched matmul whose row count is the chunk's, and a row's softmax and
value sums run over the whole context with the later positions masked, so the same token gets
other bits in a chunk of 5 than decoded alone. Here every row is the reference's one-row decode
(causal_attention with q_len 1) over the first `position + 1` keys: a prefill chunk, a verify of
k + 1 rows and a decode compute a row the same way, with one split (none) and one order, set by
the context length alone. Slower on long prefills (one call per row); the mode trades that.

The Triton form, for CUDA: triton_batch_invariant.py (BatchInvariantTritonAttention).
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import causal_attention, gather_kv, sequence_rows, write_kv_torch


def attend_rows_torch(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]: the last q_len positions of the context
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, v_head_dim]
    scale: float,
    out: torch.Tensor,  # [q_len, num_heads, v_head_dim]: written row by row
) -> None:
    q_len, seq_len = query.shape[0], key.shape[0]
    for j in range(q_len):
        context_len = seq_len - q_len + j + 1
        # A fresh float32 copy: the row's operand looks the same wherever it sat in the batch.
        row = query[j : j + 1].to(torch.float32, copy=True)  # [1, num_heads, head_dim]
        out[j : j + 1] = causal_attention(row, key[:context_len], value[:context_len], scale)


class BatchInvariantTorchAttention:
    name = "torch_batch_invariant"  # ops/mla/dispatch.py gives its MLA layers the MLA twin of this
    graph_safe = False  # loops over the host copies of the lengths
    fuses_rope = False
    batch_invariant = True

    def write_kv(self, key, value, kv_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # FP8 caches: what a stored key / value is multiplied by
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        out = torch.empty_like(query)
        for i, lo, hi, seq_len in sequence_rows(metadata):
            key, value = gather_kv(kv_cache, metadata.block_table[i], seq_len, k_scale, v_scale)
            attend_rows_torch(query[lo:hi], key, value, scale, out[lo:hi])
        return out
