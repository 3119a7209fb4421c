"""Linear layers whose parameters know how checkpoint tensors fill them.

Every parameter here carries `weight_loader(param, loaded_tensor, shard_id)`, the hook the generic
loader calls. Unfused parameters take the whole tensor (shard_id None); fused ones take one named
slice per checkpoint tensor and list the slices they expect in `param.shard_ids`, so the loader can
tell a half-loaded fused parameter from a complete one.

Values are converted with `tensor.to(param.dtype)` (by value, never by reinterpreting bits), and a
tensor of the wrong shape raises ValueError with the expected and found shapes; the loader adds
the parameter name, checkpoint key and file.

A Linear computes F.linear, or, once prepare_small_m_linears (small_m.py) has bound a
SmallMGemm to it (on CUDA, before graph capture), lets that pick cuBLAS or the Triton GEMV for
few-row inputs; `MergedLinear.forward_gated` is an MLP's gate_up projection with its activation,
which those kernels apply as their epilogue.

Tensor parallelism (a TensorParallel with several ranks, distributed/tensor_parallel.py): the
fused q/k/v and gate_up layers and ColumnParallelLinear hold this rank's rows of the output (no
collective: their consumer works on its heads or columns); RowParallelLinear holds its columns of
the input and sums the partial products over ranks. Such parameters also carry `rank_slices`
(shard id -> RankSlice): which part of each checkpoint tensor this rank holds, so the loader
reads only that part and the weight_loader gets it already cut. With one rank (the default)
the layers are exactly the unsplit ones and carry no rank_slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.ops.pointwise.dispatch import silu_and_mul

if TYPE_CHECKING:
    from foretell.ops.gemm.dispatch import SmallMGemm


def check_shape(loaded: torch.Tensor, expected: Sequence[int], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{what}: expected shape {tuple(expected)}, found shape {tuple(loaded.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole checkpoint tensor into an unfused parameter, converting dtype by value."""
    if shard_id is not None:
        raise ValueError(f"parameter is not fused but was given shard {shard_id!r}")
    check_shape(loaded, param.shape, "parameter")
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


def make_param(
    shape: Sequence[int], dtype: torch.dtype | None, device: torch.device | str | None
) -> nn.Parameter:
    param = nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


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


class ShardedLoader:
    """weight_loader for a parameter fused along dim 0 from named slices.

    `shards` maps a shard id to (row offset, row count); a tensor for that shard must have the
    parameter's shape with dim 0 replaced by the row count.
    """

    def __init__(self, shards: dict[Any, tuple[int, int]]):
        self.shards = shards

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id not in self.shards:
            raise ValueError(
                f"fused parameter has shards {list(self.shards)}, was given shard {shard_id!r}"
            )
        offset, size = self.shards[shard_id]
        check_shape(loaded, (size, *param.shape[1:]), f"shard {shard_id!r}")
        with torch.no_grad():
            param.narrow(0, offset, size).copy_(loaded.to(param.dtype))


def make_sharded_param(
    rest_shape: Sequence[int],
    shard_sizes: dict[Any, int],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Parameter:
    """A parameter of shape [sum(shard_sizes), *rest_shape] filled slice by slice, in dict order."""
    shards, offset = {}, 0
    for shard_id, size in shard_sizes.items():
        shards[shard_id] = (offset, size)
        offset += size
    param = nn.Parameter(
        torch.empty((offset, *rest_shape), dtype=dtype, device=device), requires_grad=False
    )
    param.weight_loader = ShardedLoader(shards)
    param.shard_ids = tuple(shard_sizes)
    return param


class Linear(nn.Module):
    """y = x W^T (+ b), W [output_size, input_size], loaded whole from one checkpoint tensor."""

    # Set per instance by prepare_small_m_linears; the class default (never changed) is F.linear.
    small_m: "SmallMGemm | None" = None
    # Whether the bias is added by the matmul (the small-M kernels are chosen with it); a
    # row-parallel layer adds it after the sum over ranks instead.
    bias_in_gemm = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = make_param((output_size, input_size), dtype, device)
        self.bias = make_param((output_size,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input] -> [..., output]
        if self.small_m is not None:
            return self.small_m(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (e.g. gate_up).

    Checkpoint tensor i (shard id i, an int) fills output rows sum(output_sizes[:i]) onwards.
    Column-parallel with tp: each part is split evenly and this rank holds its share of every
    part, in the same order ([gate_r | up_r] for a gate_up projection).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp: TensorParallel | None = None,
    ):
        nn.Module.__init__(self)
        tp = tp or TensorParallel()
        slices = even_slices(dict(enumerate(output_sizes)), 0, tp, "a fused projection's output size")
        self.input_size = input_size
        self.output_sizes = tuple(s.size for s in slices.values())  # this rank's
        self.output_size = sum(self.output_sizes)
        sizes = dict(enumerate(self.output_sizes))
        self.weight = make_sharded_param((input_size,), sizes, dtype, device)
        self.bias = make_sharded_param((), sizes, dtype, device) if bias else None
        set_rank_slices(self.weight, slices, tp)
        set_rank_slices(self.bias, slices, tp)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:  # [..., input] -> [..., output // 2]
        """silu_and_mul(self(x)) for a [gate; up] projection (two equal parts): where the few-row
        kernels run the layer, the activation is their epilogue (no gate_up tensor, no launch)."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"forward_gated needs two equal parts (gate, up), this has {list(self.output_sizes)}")
        if self.small_m is not None:
            return self.small_m(x, self.weight, self.bias, gated=True)
        return silu_and_mul(F.linear(x, self.weight, self.bias))


class QKVLinear(Linear):
    """The q, k and v projections fused into one matmul; shard ids "q", "k", "v".

    Output layout: [q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same as k)].
    Column-parallel with tp: this rank's query heads and KV heads (kv_head_shard), so
    `num_heads` and `num_kv_heads` here are this rank's counts.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp: TensorParallel | None = None,
    ):
        nn.Module.__init__(self)
        tp = tp or TensorParallel()
        first_kv, self.num_kv_heads = kv_head_shard(num_heads, num_kv_heads, tp)
        first_q, self.num_heads = tp.even_shard(num_heads, "num_attention_heads")
        self.input_size = hidden_size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.output_size = self.q_size + 2 * self.kv_size
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.weight = make_sharded_param((hidden_size,), sizes, dtype, device)
        self.bias = make_sharded_param((), sizes, dtype, device) if bias else None
        kv_slice = RankSlice(0, first_kv * head_dim, self.kv_size, num_kv_heads * head_dim)
        slices = {"q": RankSlice(0, first_q * head_dim, self.q_size, num_heads * head_dim),
                  "k": kv_slice, "v": kv_slice}
        set_rank_slices(self.weight, slices, tp)
        set_rank_slices(self.bias, slices, tp)

    def split(
        self, qkv: torch.Tensor  # [num_tokens, q_size + 2 * kv_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


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
    ):
        tp = tp or TensorParallel()
        start, part = tp.even_shard(output_size, "a column-parallel layer's output size")
        super().__init__(input_size, part, bias, dtype=dtype, device=device)
        row_slice = {None: RankSlice(0, start, part, output_size)}
        set_rank_slices(self.weight, row_slice, tp)
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
    ):
        tp = tp or TensorParallel()
        start, part = tp.even_shard(input_size, "a row-parallel layer's input size")
        super().__init__(part, output_size, bias, dtype=dtype, device=device)
        self.tp = tp
        set_rank_slices(self.weight, {None: RankSlice(1, start, part, input_size)}, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input / ranks] -> [..., output]
        if self.small_m is not None:
            partial = self.small_m(x, self.weight, None)
        else:
            partial = F.linear(x, self.weight)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out.add_(self.bias)


def row_parallel_linear(
    input_size: int,
    output_size: int,
    bias: bool = False,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp: TensorParallel | None = None,
) -> Linear:
    """A RowParallelLinear over several ranks; a plain Linear for one (no collective, the bias in
    the matmul: exactly today's layer)."""
    if tp is None or not tp.is_parallel:
        return Linear(input_size, output_size, bias, dtype=dtype, device=device)
    return RowParallelLinear(input_size, output_size, bias, dtype=dtype, device=device, tp=tp)
