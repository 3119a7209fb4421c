"""KV cache memory: the target's paged cache and the draft's own (DraftKVCache), carved from
one budget so that both hold the same number of tokens.

Each attention layer says what one of its blocks holds (`kv_cache_shape(num_blocks, block_size)`),
so a GQA layer, an MLA layer (latent + rope key) and a draft layer are sized the same way. Both
caches index one flat token-slot space: target block b of size B covers slots b*B .. b*B + B-1,
and the draft, with block size B/r, sees the same slots as blocks b*r .. b*r + r-1. So
draft_num_blocks = target_num_blocks * B / draft_block_size, and one slot mapping serves both.

The caches' dtype is CacheConfig.kv_cache_dtype (`kv_cache_dtypes`): the model's (and the
drafter's) for auto; float8_e4m3fn for both with fp8, one byte an element, so a budget holds
exactly twice the tokens it holds in bf16 (ops/attention/fp8_kv.py: the format and its scales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from foretell.ops.attention.fp8_kv import kv_cache_torch_dtype


def kv_cache_dtypes(
    kv_cache_dtype: str,  # CacheConfig.kv_cache_dtype: auto | fp8 | fp8_e4m3
    model_dtype: torch.dtype,
    draft_dtype: torch.dtype | None,  # the drafter's compute dtype (None: the model's)
) -> tuple[torch.dtype, torch.dtype]:  # (target cache dtype, draft cache dtype)
    """What the target's and the draft's caches store: their compute dtypes for auto, e4m3 for
    both with fp8 (the draft's cache is quantized like the target's)."""
    return (kv_cache_torch_dtype(kv_cache_dtype, model_dtype),
            kv_cache_torch_dtype(kv_cache_dtype, draft_dtype or model_dtype))


def bytes_per_token(layers: list[nn.Module], dtype: torch.dtype) -> int:
    """Cache bytes one token takes over `layers` in a cache of `dtype` (1 per element for FP8)."""
    elem = dtype.itemsize
    return sum(math.prod(layer.kv_cache_shape(1, 1)) for layer in layers) * elem


@dataclass
class CachePlan:
    num_blocks: int  # target blocks
    block_size: int
    draft_num_blocks: int
    draft_block_size: int
    target_bytes_per_token: int
    draft_bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * (self.target_bytes_per_token + self.draft_bytes_per_token)


def plan_cache(
    budget_bytes: int | None,
    num_blocks_override: int | None,
    target_layers: list[nn.Module],
    dtype: torch.dtype,  # the target cache's dtype (kv_cache_dtypes)
    block_size: int,
    draft_layers: list[nn.Module] = (),
    draft_dtype: torch.dtype | None = None,  # the draft cache's dtype (None: the target cache's)
    draft_block_size: int | None = None,
) -> CachePlan:
    draft_block_size = draft_block_size or block_size
    if block_size % draft_block_size != 0:
        raise ValueError(
            f"draft_block_size ({draft_block_size}) must divide the target block size "
            f"({block_size}) so both caches share one slot mapping"
        )
    target_bpt = bytes_per_token(target_layers, dtype)
    draft_bpt = bytes_per_token(list(draft_layers), draft_dtype or dtype) if draft_layers else 0
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    else:
        per_block = (target_bpt + draft_bpt) * block_size
        num_blocks = int(budget_bytes // per_block) if per_block else 0
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget of {budget_bytes} bytes holds no block of {per_block} bytes "
                f"(block_size {block_size}); give the cache more memory "
                f"(--kv-cache-memory-bytes, --gpu-memory-utilization or --num-kv-blocks)"
            )
    return CachePlan(
        num_blocks=num_blocks,
        block_size=block_size,
        draft_num_blocks=num_blocks * block_size // draft_block_size,
        draft_block_size=draft_block_size,
        target_bytes_per_token=target_bpt,
        draft_bytes_per_token=draft_bpt,
    )


class KVCache:
    """One cache tensor per attention layer, bound to the layer (binding reads the layer's FP8
    scales, so it happens after the weights are loaded)."""

    def __init__(
        self,
        layers: list[nn.Module],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.tensors = [
            torch.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)
            for layer in layers
        ]
        for layer, tensor in zip(layers, self.tensors):
            layer.bind_kv_cache(tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class DraftKVCache(KVCache):
    """The draft's own cache: its block size, number of blocks and dtype, beside the target's."""


CPU_KV_CACHE_BYTES = 256 << 20  # the CPU's cache when no size is given


def kv_cache_budget(cache_config, device: torch.device) -> int | None:
    """Bytes for the KV caches (target and draft): the configured size; on the CPU, 256 MiB; on a
    GPU, what is free after the weights less (1 - gpu_memory_utilization) of the card and 2 GiB
    for activations."""
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    reserve = (1 - cache_config.gpu_memory_utilization) * total + (2 << 30)
    budget = int(free - reserve)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB after loading the weights, and {reserve / 2**30:.1f} GiB "
            f"is kept back (1 - gpu_memory_utilization, plus 2 GiB for activations); raise "
            f"--gpu-memory-utilization, or set --kv-cache-memory-bytes or --num-kv-blocks"
        )
    return budget
