"""What the launchers of the paged-cache kernels share: the cache layout check, the inputs' unit
last stride and tree-mask rows, and the attention's tile sizes and context split, all from shapes
only (so the choices are the same in eager mode and in a captured CUDA graph).

Used by triton_paged.py (the GQA attention), triton_write_kv.py (the KV write), triton_rope_paged.py
(RoPE + KV write + attention in one launch) and the MLA kernels (ops/mla/), which take the split
choice and the stride helper.
"""

from __future__ import annotations

import functools

import torch
import triton

# A split of the context covers at least this many tokens (rounded up to whole tiles): a short
# context runs as few pieces, a long one as up to num_splits. One tile per piece measured best on
# the H200 at Llama-8B batch 1 (docs/perf-log.md).
MIN_SPLIT_TOKENS = 32


def paged_launch_config(
    group: int, head_dim: int, max_query_len: int, cache_dtype: torch.dtype  # the tiles' dtype
) -> dict:
    group_p = triton.next_power_of_2(group)
    # float32 tiles take the FMA path (exact "ieee" dot) and spill when large: keep them small.
    wide = cache_dtype.itemsize > 2
    # About 64 rows per program for prefill; decode/verify take just enough tokens to hold
    # their queries, but never fewer than 16 rows (the smallest tl.dot M).
    target_rows = 16 if wide else (64 if head_dim <= 128 else 32)
    block_q = min(triton.next_power_of_2(max(max_query_len, 1)), max(1, target_rows // group_p))
    block_q = max(block_q, 16 // min(group_p, 16))
    if wide:
        tile_n = 16
    else:
        tile_n = 64 if head_dim <= 128 else 32
    return {
        "BLOCK_Q": block_q,
        "BLOCK_M": block_q * group_p,
        "TILE_N": tile_n,
        "num_warps": 8 if block_q * group_p >= 128 else 4,
    }


def choose_num_splits(
    device: torch.device,
    active_programs: int,
    max_context: int,
    max_query_len: int,
    tile_n: int,
    max_splits: int = 64,
) -> int:
    """Split the context when decode/verify would leave most SMs idle, into at most max_splits
    pieces. Shapes only, so the choice is the same in eager mode and in a captured CUDA graph."""
    if max_query_len > 16 or device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * multiprocessor_count(device.index or 0), active_programs)
    # Keep at least a couple of tiles per split over the longest context the table can hold.
    cap = max(1, max_context // (2 * tile_n))
    splits = min(wanted, cap, max_splits)
    return 1 if splits <= 1 else triton.next_power_of_2(splits)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    # A fixed hardware fact, memoised so a launch never re-queries the driver.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tree_mask_rows(tree_mask: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
    """The mask as int8 rows with a unit stride (a bool or uint8 mask is viewed, not copied)."""
    if tree_mask is None:
        return None
    if tree_mask.dim() != 2 or tree_mask.shape[0] < num_tokens or tree_mask.dtype not in (
        torch.bool, torch.int8, torch.uint8
    ):
        raise ValueError(
            f"tree_mask must be [num_tokens={num_tokens}, W] bool, int8 or uint8; got "
            f"{tuple(tree_mask.shape)} {tree_mask.dtype}"
        )
    tree_mask = unit_last_stride(tree_mask)
    return tree_mask if tree_mask.dtype == torch.int8 else tree_mask.view(torch.int8)


def unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def check_paged_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] with a unit "
            f"stride on head_dim; got shape {tuple(kv_cache.shape)}, stride {kv_cache.stride()}"
        )
