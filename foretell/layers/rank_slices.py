"""Which part of each checkpoint tensor a tensor-parallel rank holds (a TensorParallel with
several ranks, distributed/tensor_parallel.py): `RankSlice`, and the helpers that cut and attach them.

Parameters split over ranks carry `rank_slices` (shard id -> RankSlice): which part of each
checkpoint tensor this rank holds, so the loader reads only that part and the weight_loader
(weight_loaders.py) gets it already cut. With one rank (the default) the layers are exactly the
unsplit ones and carry no rank_slices.

An FP8 weight's block scales are cut like the weight, in blocks (`block_slices`): the weight's
cut must fall on block boundaries (layers/linear.py checks it at construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.ops.gemm.fp8_reference import blocks


@dataclass(frozen=True)
class RankSlice:
    """The part of a checkpoint tensor one rank holds: `size` entries from `start` along `dim`,
    out of the checkpoint's `full_size` there (checked before cutting, so a misshapen tensor is
    reported rather than cut to fit)."""

    dim: int
    start: int
    size: int
    full_size: int

    def check_full_shape(self, shape: Sequence[int]) -> None:
        if len(shape) <= self.dim or shape[self.dim] != self.full_size:
            raise ValueError(
                f"expected size {self.full_size} along dim {self.dim} (split over tensor-parallel "
                f"ranks), found shape {tuple(shape)}"
            )

    def take(self, full: torch.Tensor) -> torch.Tensor:  # the checkpoint tensor -> this rank's part
        self.check_full_shape(full.shape)
        return full.narrow(self.dim, self.start, self.size)


def even_slices(sizes: dict[Any, int], dim: int, tp: TensorParallel, what: str) -> dict[Any, RankSlice]:
    """shard id -> this rank's even share of each checkpoint tensor along dim."""
    slices = {}
    for shard_id, size in sizes.items():
        start, part = tp.even_shard(size, what)
        slices[shard_id] = RankSlice(dim, start, part, size)
    return slices


def block_slices(slices: dict[Any, RankSlice], block: tuple[int, int], what: str) -> dict[Any, RankSlice]:
    """The rank slices of an FP8 weight's block scales, from the weight's: the same cut in blocks.
    ValueError unless the cut falls on block boundaries."""
    out = {}
    for shard_id, part in slices.items():
        b = block[part.dim]
        ragged_end = part.start + part.size == part.full_size
        if part.start % b or (part.size % b and not ragged_end):
            axis = "rows" if part.dim == 0 else "columns"
            raise ValueError(
                f"{what}: tensor parallelism gives this rank {axis} {part.start}..{part.start + part.size} of "
                f"{part.full_size}, which cuts inside the FP8 checkpoint's {b}-wide blocks "
                f"(quantization_config.weight_block_size {list(block)}); choose a tensor_parallel_size whose "
                f"share of {part.full_size} is a multiple of {b}"
            )
        out[shard_id] = RankSlice(part.dim, part.start // b, blocks(part.size, b), blocks(part.full_size, b))
    return out


def kv_head_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, KV heads) this rank holds. KV heads are split like the query heads; with
    fewer KV heads than ranks each rank holds the one its query heads attend to (replicated over
    world_size / num_kv_heads ranks), which needs world_size to be a multiple of num_kv_heads."""
    tp.even_shard(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.world_size:
        return tp.even_shard(num_kv_heads, "num_key_value_heads")
    if tp.world_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads = {num_kv_heads} is fewer than tensor_parallel_size = "
            f"{tp.world_size} and does not divide it (KV heads are then replicated, which needs "
            f"tensor_parallel_size to be a multiple of num_key_value_heads)"
        )
    return tp.rank * num_kv_heads // tp.world_size, 1


def set_rank_slices(param: nn.Parameter | None, slices: dict[Any, RankSlice], tp: TensorParallel) -> None:
    if param is not None and tp.is_parallel:
        param.rank_slices = slices
