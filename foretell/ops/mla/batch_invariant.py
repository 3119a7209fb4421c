"""Multi-head Latent Attention of the batch-invariant mode (ModelConfig.batch_invariant, issue 23), in
torch: every query row in the absorbed form, alone, over exactly its own context.

TorchMLABackend (reference.py) picks the form by the chunk's query length (absorbed up to 16 rows,
expanded above) and runs a sequence's rows through one einsum and one attention, so a row's bits
depend on its chunk. Here each row is absorbed_attention of one row over the first
`position + 1` cache entries: its W_UK fold, scores, softmax, value sum and W_UV projection are
calls whose shapes are set by the row's own context length. What the CPU runs; on CUDA the mode's
MLA layers get batch_invariant_triton.py's kernels (ops/mla/dispatch.py).
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import sequence_rows
from foretell.ops.mla.reference import TorchMLABackend, absorbed_attention, gather_latents, split_kv_b


class BatchInvariantTorchMLABackend(TorchMLABackend):
    """TorchMLABackend's norm, RoPE and cache write (row-local), and a per-row absorbed attend."""

    name = "torch_batch_invariant"

    def attend(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope + v), kv_lora_rank]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        metadata: AttentionMetadata,
        scale: float,
        v_head_dim: int,
        absorb: bool | None = None,  # accepted for the interface; every row is absorbed here
        k_scale: float = 1.0,  # FP8 caches: an entry stands for stored * k_scale
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        if absorb is False:
            raise ValueError("the batch-invariant MLA backend attends every row in the absorbed form; absorb=False "
                             "asks for the expanded one")
        num_tokens, num_heads, nope = q_nope.shape
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope, v_head_dim)
        out = q_nope.new_empty(num_tokens, num_heads, v_head_dim)
        for i, lo, hi, seq_len in sequence_rows(metadata):
            context = gather_latents(kv_cache, metadata.block_table[i], seq_len, k_scale, q_nope.dtype)
            for t in range(lo, hi):
                context_len = seq_len - (hi - t) + 1
                # Fresh copies: the row's operands look the same wherever it sat in the batch.
                row_nope, row_pe = q_nope[t : t + 1].clone(), q_pe[t : t + 1].clone()
                out[t : t + 1] = absorbed_attention(row_nope, row_pe, w_uk, w_uv, context[:context_len], scale)
        return out
