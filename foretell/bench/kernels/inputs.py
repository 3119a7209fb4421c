"""Random inputs for one kernel call, built from shapes and a dtype on a device: what the kernel
benchmarks time and what a script can reuse without test fixtures or a model.

Every builder is deterministic for its seed. Caches are paged the way a long-running server's
allocator leaves them (each sequence's blocks scattered over the pool); weights are scaled by
1 / sqrt(fan-in) so that products stay near unit size whatever the width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.ops.attention.metadata import AttentionMetadata


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, generator=gen) * scale).to(dtype)


def paged_metadata(batch: int, context: int, query_len: int, block_size: int,
                   device: torch.device, gen: torch.Generator) -> AttentionMetadata:
    """`batch` sequences of `context` tokens each, the last query_len of them new this step, their
    blocks a random permutation of a pool of exactly the blocks they need."""
    if not 1 <= query_len <= context:
        raise ValueError(f"query_len must be in [1, context={context}], got {query_len}")
    blocks_per_seq = -(-context // block_size)
    table = torch.randperm(batch * blocks_per_seq, device=device, generator=gen)
    table = table.to(torch.int32).view(batch, blocks_per_seq)  # [batch, blocks_per_seq]
    starts = [i * query_len for i in range(batch + 1)]
    lens = [context] * batch
    positions = torch.arange(context - query_len, context, device=device)  # [query_len]
    slots = table[:, positions // block_size].to(torch.int64) * block_size + positions % block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=slots.flatten(),  # [batch * query_len]
        block_size=block_size,
        max_query_len=query_len,
        max_seq_len=context,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


@dataclass
class PagedAttentionInputs:
    query: torch.Tensor  # [batch * query_len, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata


def paged_attention_inputs(batch: int, context: int, query_len: int, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device,
                           seed: int = 0) -> PagedAttentionInputs:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    gen = generator(device, seed)
    metadata = paged_metadata(batch, context, query_len, block_size, device, gen)
    num_blocks = metadata.block_table.numel()
    cache = randn((2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device, gen)
    query = randn((batch * query_len, num_heads, head_dim), dtype, device, gen)
    return PagedAttentionInputs(query, cache, metadata)


@dataclass
class LatentAttentionInputs:
    q_nope: torch.Tensor  # [batch * query_len, num_heads, qk_nope_head_dim]
    q_pe: torch.Tensor  # [batch * query_len, num_heads, qk_rope_head_dim], rotated
    kv_b_weight: torch.Tensor  # [num_heads * (qk_nope + v_head_dim), kv_lora_rank]
    kv_cache: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    metadata: AttentionMetadata


def latent_attention_inputs(batch: int, context: int, query_len: int, num_heads: int, kv_lora_rank: int,
                            qk_rope_head_dim: int, qk_nope_head_dim: int, v_head_dim: int, block_size: int,
                            dtype: torch.dtype, device: torch.device, seed: int = 0) -> LatentAttentionInputs:
    gen = generator(device, seed)
    metadata = paged_metadata(batch, context, query_len, block_size, device, gen)
    tokens, num_blocks = batch * query_len, metadata.block_table.numel()
    cache = randn((num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), dtype, device, gen)
    q_nope = randn((tokens, num_heads, qk_nope_head_dim), dtype, device, gen)
    q_pe = randn((tokens, num_heads, qk_rope_head_dim), dtype, device, gen)
    kv_b = randn((num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank), dtype, device, gen,
                 kv_lora_rank**-0.5)
    return LatentAttentionInputs(q_nope, q_pe, kv_b, cache, metadata)


@dataclass
class ExpertInputs:
    hidden: torch.Tensor  # [num_tokens, hidden]
    gate_up: torch.Tensor  # [num_experts, 2 * intermediate, hidden]
    down: torch.Tensor  # [num_experts, hidden, intermediate]
    weights: torch.Tensor  # [num_tokens, top_k] float32
    ids: torch.Tensor  # [num_tokens, top_k] int64, distinct per token

    @property
    def experts_used(self) -> int:
        return int(self.ids.unique().numel())


def routing(num_tokens: int, num_experts: int, top_k: int, device: torch.device,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, ids [T, top_k] int64): top_k distinct random experts a token."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    ids = torch.rand(num_tokens, num_experts, device=device, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, device=device, generator=gen)
    return weights, ids


def expert_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                  dtype: torch.dtype, device: torch.device, seed: int = 0) -> ExpertInputs:
    gen = generator(device, seed)
    x = randn((num_tokens, hidden), dtype, device, gen)
    gate_up = randn((num_experts, 2 * intermediate, hidden), dtype, device, gen, hidden**-0.5)
    down = randn((num_experts, hidden, intermediate), dtype, device, gen, intermediate**-0.5)
    weights, ids = routing(num_tokens, num_experts, top_k, device, gen)
    return ExpertInputs(x, gate_up, down, weights, ids)


@dataclass
class Int4ExpertInputs:
    hidden: torch.Tensor  # [num_tokens, H]
    gate_up_packed: torch.Tensor  # [E, 2 * I, ceil(H / 8)] int32
    gate_up_scale: torch.Tensor  # [E, 2 * I, ceil(H / group)]
    down_packed: torch.Tensor  # [E, H, ceil(I / 8)] int32
    down_scale: torch.Tensor  # [E, H, ceil(I / group)]
    weights: torch.Tensor  # [num_tokens, top_k] float32
    ids: torch.Tensor  # [num_tokens, top_k] int64


def int4_expert_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                       dtype: torch.dtype, device: torch.device, seed: int = 0) -> Int4ExpertInputs:
    """Random packed words (every nibble a random int4) and scales that keep products near unit
    size, in the compressed-tensors layout of ops/moe/int4_reference.py."""
    from foretell.ops.moe.int4_reference import INT4_GROUP, groups, words

    gen = generator(device, seed)

    def packed(n: int, k: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31, (num_experts, n, words(k)), device=device, generator=gen,
                             dtype=torch.int64).to(torch.int32)

    def scale(n: int, k: int) -> torch.Tensor:  # int4 values have an rms near 4.6
        noise = randn((num_experts, n, groups(k, INT4_GROUP)), torch.float32, device, gen, 0.1)
        return ((1.0 + noise) * (0.2 * k**-0.5)).to(dtype)

    x = randn((num_tokens, hidden), dtype, device, gen)
    weights, ids = routing(num_tokens, num_experts, top_k, device, gen)
    return Int4ExpertInputs(x, packed(2 * intermediate, hidden), scale(2 * intermediate, hidden),
                            packed(hidden, intermediate), scale(hidden, intermediate), weights, ids)


def linear_weight(n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    """[N, K] in dtype, scaled by 1 / sqrt(K)."""
    return randn((n, k), dtype, device, generator(device, seed), k**-0.5)


def fp8_block_weight(n: int, k: int, block_size: tuple[int, int], device: torch.device,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [N, K] float8_e4m3fn, scale [ceil(N / bn), ceil(K / bk)] float32): a random float
    weight block-quantized as the DeepSeek / Kimi checkpoints ship it."""
    from foretell.ops.gemm.fp8_reference import quantize_fp8_blocks

    return quantize_fp8_blocks(linear_weight(n, k, torch.float32, device, seed), block_size)
