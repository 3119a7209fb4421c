"""Multi-head Latent Attention of the batch-invariant mode on CUDA (issue 23): TritonMLABackend's kernels
(triton_latent_write.py, triton_fused.py, triton_attention.py) launched with one shape for every step,
so that a query row's output depends on its own query, its own context and the weights only. Graph
safe: nothing reads host lengths (the torch form in batch_invariant.py loops over rows on the host).

Every row is attended in the absorbed form (as TritonMLABackend does for every query length). What
makes the default launches step-dependent, and what is fixed here:
  - attention: the split count (flash-decoding) comes from the number of active programs, i.e. the
    batch: here 1 (a row's context walked in one pass, TILE_N-token tiles 0, 1, 2, ... in order, the
    split count and merge order thereby the same function of the row's own context length in a
    decode, a verify or a prefill chunk); the tile rows (BLOCK_M: query tokens x heads per program)
    come from the step's longest query: here sized for LAUNCH_QUERY_LEN whatever the step holds.
    A row shares a program only with later rows of its own sequence (BLOCK_Q > 1 when the model has
    few heads): their extra tiles are fully masked for it, and an online-softmax step over a fully
    masked tile multiplies by exactly 1 and adds exactly 0 (as in ops/attention/
    triton_batch_invariant.py);
  - the per-head matmuls (q_nope . W_UK, o_lat . W_UV^T): head_matmul_config picks BLOCK_K by the
    token count: here the decode tiles for every count (a row's K chunks in one order), and q_pe's
    RoPE always rides in the matmul launch (the prefill path's separate RoPE kernel could contract
    its products into FMAs differently);
  - the latent write (RMSNorm, k_pe RoPE, cache store) is one program per token already.

The contract is BatchInvariantTorchMLABackend's (the torch form; another order, so compared within
rounding). tests/ops/test_batch_invariant_attention.py runs it in Triton's interpreter (float16 /
float32), tests/gpu/test_batch_invariant_gpu.py bitwise in bf16 on the device.
"""

from __future__ import annotations

import torch

from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.triton_fp8_kv import compute_dtype
from foretell.ops.mla.reference import split_kv_b
from foretell.ops.mla.triton_attention import mla_attention_triton, mla_launch_config
from foretell.ops.mla.triton_backend import TritonMLABackend
from foretell.ops.mla.triton_fused import _launch_head_matmul, head_matmul_config, project_values_triton

# The query length every attention launch is sized for: with DeepSeek's 16 or 128 heads a program
# holds one token's heads (BLOCK_Q = 1), so a row walks exactly its own context.
LAUNCH_QUERY_LEN = 1
# head_matmul_config's decode tiles are what every token count runs.
TILE_TOKENS = 1


def attention_tiles(num_heads: int, tiles_dtype: torch.dtype) -> dict:
    """The attention's launch config for every step (mla_launch_config at LAUNCH_QUERY_LEN)."""
    return mla_launch_config(num_heads, LAUNCH_QUERY_LEN, tiles_dtype)


class BatchInvariantTritonMLABackend(TritonMLABackend):
    """TritonMLABackend's interface with the launches fixed as the module docstring says."""

    graph_safe = True
    name = "triton_batch_invariant"

    def absorb_launch(self, nope: int, rank: int, dtype: torch.dtype) -> dict:
        return {"fused_rope": True, "config": head_matmul_config(TILE_TOKENS, nope, rank, dtype)}

    def attention_launch(self, num_heads: int, kv_cache: torch.Tensor, dtype: torch.dtype) -> dict:
        return {"num_splits": 1, "config": attention_tiles(num_heads, compute_dtype(kv_cache, dtype))}

    def project_launch(self, rank: int, v_head_dim: int, dtype: torch.dtype) -> dict:
        return {"config": head_matmul_config(TILE_TOKENS, rank, v_head_dim, dtype)}

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
        k_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        if absorb is False:
            raise ValueError("the batch-invariant MLA backend attends every row in the absorbed form; absorb=False "
                             "asks for the expanded one")
        metadata.check_cache_block_size(kv_cache.shape[1], "MLA cache")
        num_tokens, num_heads, nope = q_nope.shape
        rank = kv_cache.shape[-1] - q_pe.shape[-1]
        w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope, v_head_dim)
        q_lat = torch.empty(num_tokens, num_heads, rank, dtype=q_nope.dtype, device=q_nope.device)
        if num_tokens:
            # B[h][k=d, j=r] = W_UK[h, d, r]; the same tiles as attend_projections' absorb
            _launch_head_matmul(q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous(), w_uk,
                                (w_uk.stride(0), w_uk.stride(1), 1), q_lat, rank,
                                config=head_matmul_config(TILE_TOKENS, nope, rank, q_nope.dtype))
        o_lat = torch.empty(num_tokens, num_heads, rank, dtype=q_lat.dtype, device=q_lat.device)
        mla_attention_triton(q_lat, q_pe, kv_cache, metadata.block_table, metadata.seq_lens,
                             metadata.query_start_loc, metadata.max_query_len, scale, o_lat, k_scale=k_scale,
                             **self.attention_launch(num_heads, kv_cache, q_lat.dtype))
        return project_values_triton(o_lat, w_uv, **self.project_launch(rank, v_head_dim, q_nope.dtype))
