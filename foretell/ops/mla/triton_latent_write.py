"""The writes into MLA's latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one
program per token; slot -1 (a CUDA-graph padding row) writes nothing.

  latent_write_triton   the fused kv side (triton_fused.py's overview says why it is fused and how
                        it rounds): RMSNorm of the latent c (kv_a_layernorm), RoPE of the shared
                        k_pe, and the write of [c | k_pe] at slot_mapping. It reads the kv_a slice of
                        fused_qkv_a_proj's output in place (a strided view).
  write_latent_triton   the plain write of an already normed c and rotated k_pe
                        (TritonMLABackend.write_kv).

Twins in reference.py: `latent_write_torch` (RMSNorm + RoPE + TorchMLABackend.write_kv) and
`TorchMLABackend.write_kv`; tests/ops/test_mla_fused.py and tests/ops/test_mla_attention.py hold
them together (in Triton's interpreter on the CPU).

An FP8 latent cache (ops/attention/fp8_kv.py, one k_scale per layer): both store the entry /
k_scale in e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.fp8_kv import check_scale
from foretell.ops.attention.triton_fp8_kv import to_cache
from foretell.ops.attention.triton_paged_launch import unit_last_stride
from foretell.ops.common.protocols import NormModule, RotaryModule
from foretell.ops.mla.triton_rope import _pair_offsets, _rope_tables, _rotate_pairs
from foretell.ops.pointwise.triton_kernels import _in_dtype


def check_latent_cache(kv_cache: torch.Tensor, width: int) -> None:
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"the MLA cache must be [num_blocks, block_size, {width}] (kv_lora_rank + "
            f"qk_rope_head_dim) with a unit last stride; got shape {tuple(kv_cache.shape)}, "
            f"stride {kv_cache.stride()}"
        )


@triton.jit
def _latent_write_kernel(
    kv_a_ptr,  # [num_tokens, rank + rope], row stride stride_kv_a
    norm_weight_ptr,  # [rank]
    positions_ptr,  # [num_tokens] int
    cos_ptr,  # [max_positions, rope // 2] float32
    sin_ptr,
    cache_ptr,  # [num_blocks, block_size, rank + rope]
    slot_mapping_ptr,  # [num_tokens] int64; < 0: padded row
    eps,
    inv_scale,  # 1 / k_scale: an FP8 cache stores the entry scaled (unused otherwise)
    stride_kv_a,
    stride_cos,
    stride_cache_block,
    stride_cache_slot,
    RANK: tl.constexpr,
    RANK_P: tl.constexpr,
    HALF: tl.constexpr,  # rope // 2
    HALF_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    INTERLEAVED: tl.constexpr,
):
    # Every load is issued before any result is waited on (a padded row's loads are wasted, but
    # an early return would put the slot load's latency in front of all the others).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dtype = kv_a_ptr.dtype.element_ty  # the model dtype: where the torch path rounds
    cache_dtype = cache_ptr.dtype.element_ty
    row = kv_a_ptr + token * stride_kv_a
    r = tl.arange(0, RANK_P)
    r_ok = r < RANK
    i = tl.arange(0, HALF_P)
    i_ok = i < HALF
    first, second = _pair_offsets(i, HALF, INTERLEAVED)
    c = tl.load(row + r, mask=r_ok, other=0.0).to(tl.float32)  # [RANK_P]
    weight = tl.load(norm_weight_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    x1 = tl.load(row + RANK + first, mask=i_ok, other=0.0).to(tl.float32)  # [HALF_P]
    x2 = tl.load(row + RANK + second, mask=i_ok, other=0.0).to(tl.float32)
    # Padded rows (slot -1) write nothing and may carry any position. (Masks spelled as full
    # vectors: the interpreter rejects a scalar & vector mask.)
    pair_ok = i_ok & ((slot + 0 * i) >= 0)  # [HALF_P]
    rank_ok = r_ok & ((slot + 0 * r) >= 0)  # [RANK_P]
    cos = _in_dtype(tl.load(cos_ptr + position * stride_cos + i, mask=pair_ok, other=0.0), dtype)
    sin = _in_dtype(tl.load(sin_ptr + position * stride_cos + i, mask=pair_ok, other=0.0), dtype)
    entry = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot

    # RMSNorm (norm.py): normalise in float32, round, multiply by the weight, round.
    variance = tl.sum(c * c, axis=0) / RANK
    normed = _in_dtype(c * tl.rsqrt(variance + eps), dtype)
    tl.store(entry + r, to_cache((weight * normed).to(dtype), inv_scale, cache_dtype), mask=rank_ok)
    # RoPE of k_pe at the token's position.
    o1, o2 = _rotate_pairs(x1, x2, cos, sin, dtype)
    tl.store(entry + RANK + first, to_cache(o1.to(dtype), inv_scale, cache_dtype), mask=pair_ok)
    tl.store(entry + RANK + second, to_cache(o2.to(dtype), inv_scale, cache_dtype), mask=pair_ok)


def latent_write_triton(
    kv_a: torch.Tensor,  # [num_tokens, kv_lora_rank + rope], may be a strided view
    positions: torch.Tensor,  # [num_tokens] int
    kv_a_layernorm: NormModule,  # over kv_lora_rank
    rotary_emb: RotaryModule,  # rotary_dim == rope
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slots < 0 are skipped
    k_scale: float = 1.0,  # an FP8 cache (ops/attention/fp8_kv.py) stores [c | k_pe] / k_scale
) -> None:
    """Norm the latent, rotate k_pe and write [c | k_pe] into the cache, one launch."""
    rank = kv_a_layernorm.hidden_size
    weight = kv_a_layernorm.weight
    if kv_a.dim() != 2 or kv_a.shape[-1] <= rank:
        raise ValueError(
            f"kv_a must be [num_tokens, kv_lora_rank + qk_rope_head_dim] with kv_lora_rank {rank}; "
            f"got shape {tuple(kv_a.shape)}"
        )
    rope = kv_a.shape[-1] - rank
    check_latent_cache(kv_cache, rank + rope)
    if weight.shape != (rank,) or weight.dtype != kv_a.dtype:
        raise ValueError(f"kv_a_layernorm.weight must be [{rank}] {kv_a.dtype}, got "
                         f"{list(weight.shape)} {weight.dtype}")
    num_tokens = kv_a.shape[0]
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions and slot_mapping must be [{num_tokens}], got "
                         f"{list(positions.shape)} and {list(slot_mapping.shape)}")
    cos, sin = _rope_tables(rotary_emb, rope, kv_a)
    if num_tokens == 0:
        return
    kv_a = unit_last_stride(kv_a)
    _latent_write_kernel[(num_tokens,)](
        kv_a, weight, positions, cos, sin, kv_cache, slot_mapping,
        kv_a_layernorm.eps, 1.0 / check_scale("k_scale", k_scale), kv_a.stride(0), cos.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        RANK=rank, RANK_P=triton.next_power_of_2(rank),
        HALF=rope // 2, HALF_P=triton.next_power_of_2(max(rope // 2, 1)),
        BLOCK_SIZE=kv_cache.shape[1], INTERLEAVED=rotary_emb.style == "gptj",
        num_warps=4 if rank >= 512 else 1,
    )


@triton.jit
def _write_latent_kernel(
    latent_ptr,  # [num_tokens, rank]
    k_pe_ptr,  # [num_tokens, rope]
    cache_ptr,  # [num_blocks, block_size, rank + rope]
    slot_mapping_ptr,  # [num_tokens] int64
    inv_scale,  # 1 / k_scale (FP8 caches; unused otherwise)
    stride_latent,
    stride_k_pe,
    stride_cache_block,
    stride_cache_slot,
    RANK: tl.constexpr,
    RANK_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded rows (CUDA-graph padding) carry slot -1
        return
    base = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
    r = tl.arange(0, RANK_P)
    c = tl.load(latent_ptr + token * stride_latent + r, mask=r < RANK)
    tl.store(base + r, to_cache(c, inv_scale, cache_ptr.dtype.element_ty), mask=r < RANK)
    p = tl.arange(0, ROPE_P)
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe + p, mask=p < ROPE)
    tl.store(base + RANK + p, to_cache(k_pe, inv_scale, cache_ptr.dtype.element_ty), mask=p < ROPE)


def write_latent_triton(
    latent: torch.Tensor,  # [num_tokens, kv_lora_rank]
    k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slots < 0 are skipped
    k_scale: float = 1.0,  # FP8 caches store the entry / k_scale
) -> None:
    num_tokens, rank = latent.shape
    rope = k_pe.shape[-1]
    check_latent_cache(kv_cache, rank + rope)
    if num_tokens == 0:
        return
    latent, k_pe = unit_last_stride(latent), unit_last_stride(k_pe)
    _write_latent_kernel[(num_tokens,)](
        latent, k_pe, kv_cache, slot_mapping, 1.0 / check_scale("k_scale", k_scale),
        latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        RANK=rank, RANK_P=triton.next_power_of_2(rank),
        ROPE=rope, ROPE_P=triton.next_power_of_2(rope),
        BLOCK_SIZE=kv_cache.shape[1],
    )
