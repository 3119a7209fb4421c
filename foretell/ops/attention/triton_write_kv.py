"""The KV write into the paged GQA cache: each token's key and value rows stored at its slot
(slot_mapping; padded rows, slot -1, write nothing), one program per token.

Twin: `write_kv_torch` in reference.py holds the reference semantics; tests/ops/test_attention_paged.py
holds the two together on random inputs.

An FP8 cache (fp8_kv.py): the write stores key / k_scale and value / v_scale in e4m3
(triton_fp8_kv.to_cache); triton_paged.py's attention reads it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.attention.fp8_kv import check_scale
from foretell.ops.attention.triton_fp8_kv import to_cache
from foretell.ops.attention.triton_paged_launch import check_paged_cache, unit_last_stride


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_inv_scale,  # 1 / k_scale (FP8 caches; unused otherwise)
    v_inv_scale,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded rows (CUDA-graph padding) carry slot -1
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    cache_offsets = (
        block * stride_cache_block
        + offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(k_cache_ptr + cache_offsets, to_cache(key, k_inv_scale, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, to_cache(value, v_inv_scale, v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slots < 0 are skipped
    k_scale: float = 1.0,  # FP8 caches store key / k_scale
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = unit_last_stride(key)
    value = unit_last_stride(value)
    check_paged_cache(kv_cache)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        1.0 / check_scale("k_scale", k_scale),
        1.0 / check_scale("v_scale", v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
    )
