"""The attention layer a model holds: writes new K/V into its cache, then attends.

The cache tensor is bound by the runner once it is allocated (`bind_kv_cache`); the layer
declares how large a cache it needs per block through `kv_cache_shape`. The metadata must be
paged like this layer's cache (a draft with its own block size gets metadata derived once per
step with `AttentionMetadata.with_block_size`).
"""

from __future__ import annotations

import torch
from torch import nn

from foretell.layers.attention.backend import AttentionBackend
from foretell.layers.attention.metadata import AttentionMetadata


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

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if self.kv_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the runner must bind one")
        self.backend.write_kv(key, value, self.kv_cache, metadata.slot_mapping)
        return self.backend.attend(query, self.kv_cache, metadata, self.scale)
