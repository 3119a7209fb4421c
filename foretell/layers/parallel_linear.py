"""Linears split over tensor-parallel ranks (distributed/tensor_parallel.py): ColumnParallelLinear
holds this rank's rows of the output (no collective), RowParallelLinear its columns of the input,
summing the partial products over ranks; row_parallel_linear gives a plain Linear for one rank.
How their parameters load and which rank slice each holds: linear.py."""

from __future__ import annotations

import torch

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.linear import Linear
from foretell.layers.rank_slices import RankSlice, set_rank_slices


class ColumnParallelLinear(Linear):
    """A Linear whose output rows are split over ranks: this rank computes its share of the
    output features (no collective). With one rank, a Linear."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp: TensorParallel | None = None,
        fp8_block: tuple[int, int] | None = None,
    ):
        tp = tp or TensorParallel()
        start, part = tp.even_shard(output_size, "a column-parallel layer's output size")
        super().__init__(input_size, part, bias, dtype=dtype, device=device, fp8_block=fp8_block)
        row_slice = {None: RankSlice(0, start, part, output_size)}
        self.set_weight_rank_slices(row_slice, tp)
        set_rank_slices(self.bias, row_slice, tp)


class RowParallelLinear(Linear):
    """A Linear whose input features are split over ranks (the input is the column-parallel
    layer's local output): each rank multiplies its columns of W, the products are summed over
    ranks, and the bias (whole on every rank) is added once after the sum. Build it through
    row_parallel_linear, which gives a plain Linear for one rank."""

    bias_in_gemm = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp: TensorParallel | None = None,
        fp8_block: tuple[int, int] | None = None,
    ):
        tp = tp or TensorParallel()
        start, part = tp.even_shard(input_size, "a row-parallel layer's input size")
        super().__init__(part, output_size, bias, dtype=dtype, device=device, fp8_block=fp8_block)
        self.tp = tp
        self.set_weight_rank_slices({None: RankSlice(1, start, part, input_size)}, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input / ranks] -> [..., output]
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out.add_(self.bias)


def row_parallel_linear(
    input_size: int,
    output_size: int,
    bias: bool = False,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp: TensorParallel | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> Linear:
    """A RowParallelLinear over several ranks; a plain Linear for one (no collective, the bias in
    the matmul: exactly today's layer)."""
    if tp is None or not tp.is_parallel:
        return Linear(input_size, output_size, bias, dtype=dtype, device=device, fp8_block=fp8_block)
    return RowParallelLinear(input_size, output_size, bias, dtype=dtype, device=device, tp=tp, fp8_block=fp8_block)
