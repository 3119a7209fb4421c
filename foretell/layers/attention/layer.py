"""The attention layer a model holds: writes new K/V into its cache, then attends.

The cache tensor is bound by the runner once it is allocated (`bind_kv_cache`); the layer
declares how large a cache it needs per block through `kv_cache_shape`. The metadata must be
paged like this layer's cache (a draft with its own block size gets metadata derived once per
step with `AttentionMetadata.with_block_size`).

FP8 KV cache (kv_cache_dtype="fp8", ops/attention/fp8_kv.py): the layer's kv_scales.k_scale and
.v_scale (scalar float32 parameters, kv_scales.py) are what its keys and values are divided by when stored
in e4m3 and multiplied by when read. They load from the checkpoint's k_scale / v_scale when it has
them and stay 1.0 otherwise; the layer reads them once as host floats when its cache is bound (so a
captured CUDA graph holds them). A cache in the model's dtype ignores them.
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.layers.attention.kv_scales import KVScales
from foretell.ops.attention.dispatch import AttentionBackend
from foretell.ops.attention.fp8_kv import is_fp8
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.common import kernel_choice
from foretell.layers.norm import RMSNorm, rms_norm_torch
from foretell.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        backend: AttentionBackend,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales = KVScales()  # k_scale, v_scale: checkpoint keys .k_scale / .v_scale

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.kv_scales.freeze(kv_cache.dtype)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner must bind one")
        k_scale, v_scale = self.kv_scales.values
        self.backend.write_kv(key, value, self.kv_cache, metadata.slot_mapping, k_scale, v_scale)
        if metadata.tree_mask is not None:  # a draft tree's rows (only the torch and Triton backends take it)
            return self.backend.attend(query, self.kv_cache, metadata, self.scale, k_scale, v_scale,
                                       tree_mask=metadata.tree_mask)
        return self.backend.attend(query, self.kv_cache, metadata, self.scale, k_scale, v_scale)

    def forward_rotary(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        rotary_emb: RotaryEmbedding,
        metadata: AttentionMetadata,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,  # (q_norm, k_norm) per head, before RoPE
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """(q_norm / k_norm,) RoPE on query and key, then forward: the backend's rope_attend when it
        has one (the cache and norms in the query's dtype: one launch for decode and verify, two for
        prefill) and, for a draft tree's rows (metadata.tree_mask), when it also honours the mask
        (fuses_tree_rope); else the modules one after the other."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner must bind one")
        norms_fit = qk_norm is None or all(n.weight.dtype == query.dtype for n in qk_norm)
        cache_fits = self.kv_cache.dtype == query.dtype or is_fp8(self.kv_cache.dtype)
        mask_fits = metadata.tree_mask is None or getattr(self.backend, "fuses_tree_rope", False)
        if (self.backend.fuses_rope and norms_fit and cache_fits and mask_fits
                and rotary_emb.fusable(positions, query, key)):
            k_scale, v_scale = self.kv_scales.values
            return self.backend.rope_attend(positions, query, key, value, rotary_emb, self.kv_cache, metadata,
                                            self.scale, qk_norm, k_scale, v_scale)
        query, key = norm_and_rotate(positions, query, key, rotary_emb, qk_norm)
        return self(query, key, value, metadata)


def norm_and_rotate(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    rotary_emb: RotaryEmbedding,
    qk_norm: tuple[RMSNorm, RMSNorm] | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # query, key: rotated (and normed)
    """(q_norm / k_norm,) then RoPE. Off CUDA both run once over the query and key heads side by
    side ([num_tokens, num_heads + num_kv_heads, head_dim]): the same arithmetic per head as the
    modules one after the other, bit for bit, in half the launches (the CPU decode step's cost is
    mostly launches). On CUDA the modules' own kernels."""
    together = query.dtype == key.dtype and query.shape[-1] == key.shape[-1] and not kernel_choice.use_triton(query, key)
    if qk_norm is not None:
        q_norm, k_norm = qk_norm
        together = together and q_norm.eps == k_norm.eps and q_norm.weight.dtype == k_norm.weight.dtype
    if not together:
        if qk_norm is not None:
            (query, _), (key, _) = qk_norm[0](query), qk_norm[1](key)
        return rotary_emb(positions, query, key)
    num_heads = query.shape[1]
    heads = torch.cat((query, key), dim=1)  # [num_tokens, num_heads + num_kv_heads, head_dim]
    if qk_norm is not None:
        weight = torch.cat((q_norm.weight.expand(num_heads, -1), k_norm.weight.expand(key.shape[1], -1)))
        heads = rms_norm_torch(heads, weight, q_norm.eps)  # weight [num_heads + num_kv_heads, head_dim]
    heads = rotary_emb.rotate_heads(positions, heads)
    return heads[:, :num_heads], heads[:, num_heads:]
