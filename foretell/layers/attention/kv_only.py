"""An attention layer's keys and values written into its cache with no queries and no attention.

What a drafter's catch-up needs over rows that draft nothing (an EAGLE3 head over a prompt: the
head caches those rows' keys and values for later drafting and reads nothing else of them;
models/eagle3.py Eagle3Head.cache_kv). Two pieces:

trailing_projection(linear, x, start) is linear(x)[:, start:], the output rows of a fused
projection from `start` on (the k | v rows of a q | k | v projection, the kv_a rows of MLA's
q_a | kv_a). On CUDA, for a float weight that the layer multiplies through cuBLAS or its
few-row GEMM (no FP8 blocks, no batch-invariant or packed GEMM bound), it multiplies only
those rows of the weight (F.linear over weight[start:]: a third of an 8B-shaped head's q|k|v
GEMM); everywhere else it runs the layer's own projection and keeps the columns, so the
result is the full forward's bit for bit. (A GEMM over fewer output rows need not round as the
whole one does: the BLAS may block or split the reduction by the output width. On the CPU that
shows for some widths even in float32, so the CPU keeps the whole projection.)

write_rotated_kv(attn, kv, positions, rotary_emb, metadata) rotates the keys and writes keys
and values into attn's paged cache as the full block (qkv_block.attend_qkv, or
Attention.forward_rotary) writes them there, bit for bit:
  - the CPU block's form (qkv_block.fits_torch_block, NeoX over whole heads): the paired RoPE
    rows, the key heads rotated in place, one index_copy_ of keys and values side by side;
  - a Triton backend (fuses_rope) with a cache in the key's dtype or FP8: rope_write_kv_triton
    with no query heads, the launch the full block's prefill makes (its one-launch decode form,
    triton_rope_paged, rotates with the same roundings on paper, but the GPU's compiler fuses
    RoPE's products with their sums differently in the two kernels: at one row a sequence keys
    one rounding apart, tests/gpu/test_eagle3_kv_only_gpu.py; a drafter's cache, so drafts may
    differ there, never the output);
  - anything else: RotaryEmbedding.rotate_heads, then the backend's write_kv with the layer's
    FP8 scales (what norm_and_rotate and Attention.forward run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foretell.layers.attention.layer import Attention
from foretell.layers.attention.qkv_block import fits_torch_block, paired_rope_rows
from foretell.layers.cpu_few_rows import few_rows_linear, fits_few_rows
from foretell.layers.rotary import RotaryEmbedding
from foretell.ops.attention import reference as attention_reference
from foretell.ops.attention.fp8_kv import is_fp8
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.gemm.dispatch import SmallMGemm


def multiplies_rows_alone(linear, x: torch.Tensor) -> bool:
    """Whether trailing_projection multiplies only the trailing rows of linear's weight for x (the
    module docstring says when)."""
    return (x.is_cuda and not linear.is_fp8 and linear.weight.dim() == 2
            and (linear.small_m is None or type(linear.small_m) is SmallMGemm))


def trailing_projection(
    linear,  # a Linear (QKVLinear, MergedLinear) over output rows [0, start) then [start, N)
    x: torch.Tensor,  # [n, input_size]
    start: int,
    rows_alone: bool | None = None,  # None: multiplies_rows_alone; tests force either form
) -> torch.Tensor:  # [n, N - start]
    """linear(x)[:, start:] (a strided view of the whole product where the layer runs whole)."""
    if rows_alone is None:
        rows_alone = multiplies_rows_alone(linear, x)
    if not rows_alone:
        return linear(x)[:, start:]
    weight = linear.weight[start:]  # [N - start, input_size], contiguous rows
    bias = None if linear.bias is None else linear.bias[start:]
    if fits_few_rows(x, weight):
        return few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def write_rotated_kv(
    attn: Attention,
    kv: torch.Tensor,  # [T, 2 * KV * D]: keys then values, unit last stride (the CPU rotates the keys in place)
    positions: torch.Tensor,  # [T]
    rotary_emb: RotaryEmbedding,
    metadata: AttentionMetadata,
) -> None:
    """RoPE on the keys, then keys and values into attn's cache (the module docstring's three forms)."""
    if attn.kv_cache is None:
        raise RuntimeError("attention layer has no KV cache bound; the runner must bind one")
    num_tokens = kv.shape[0]
    num_kv_heads, head_dim = attn.num_kv_heads, attn.head_dim
    if kv.shape[-1] != 2 * num_kv_heads * head_dim:
        raise ValueError(f"keys and values of {num_kv_heads} heads of {head_dim} are "
                         f"{2 * num_kv_heads * head_dim} wide, got {list(kv.shape)}")
    heads = kv.view(num_tokens, 2 * num_kv_heads, head_dim)  # [T, 2 KV, D]: key heads, then value heads
    key, value = heads[:, :num_kv_heads], heads[:, num_kv_heads:]
    cache = attn.kv_cache
    rope = paired_rope_rows(rotary_emb, positions, head_dim, kv.dtype) if fits_torch_block(attn, kv) else None
    if rope is not None:  # attend_qkv's form over the key heads alone
        cos_pair, sin_pair = rope
        halves = key.reshape(num_tokens, num_kv_heads, 2, head_dim // 2)  # (x1, x2), a view
        torch.add(halves * cos_pair, halves.flip(2) * sin_pair, out=halves)  # both products made before the add
        if cache.is_contiguous():
            attention_reference.write_kv_pair_torch(heads.view(num_tokens, 2, num_kv_heads, head_dim), cache,
                                                    metadata.slot_mapping)
        else:
            attn.backend.write_kv(key, value, cache, metadata.slot_mapping)
        return
    k_scale, v_scale = attn.kv_scales.values
    if (getattr(attn.backend, "fuses_rope", False) and (cache.dtype == kv.dtype or is_fp8(cache.dtype))
            and rotary_emb.fusable(positions, key, key)):
        from foretell.ops.attention.triton_rope_kv import rope_write_kv_triton  # imports triton: CUDA only

        metadata.check_cache_block_size(cache.shape[2])
        rope_write_kv_triton(positions, key[:, :0], key, value, rotary_emb.cos_cache, rotary_emb.sin_cache, cache,
                             metadata.slot_mapping, style=rotary_emb.style, k_scale=k_scale, v_scale=v_scale)
        return
    attn.backend.write_kv(rotary_emb.rotate_heads(positions, key), value, cache, metadata.slot_mapping,
                          k_scale, v_scale)
