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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

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
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        nn.Module.__init__(self)
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.output_size = sum(output_sizes)
        sizes = dict(enumerate(self.output_sizes))
        self.weight = make_sharded_param((input_size,), sizes, dtype, device)
        self.bias = make_sharded_param((), sizes, dtype, device) if bias else None

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
    ):
        nn.Module.__init__(self)
        self.input_size = hidden_size
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.output_size = self.q_size + 2 * self.kv_size
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.weight = make_sharded_param((hidden_size,), sizes, dtype, device)
        self.bias = make_sharded_param((), sizes, dtype, device) if bias else None

    def split(
        self, qkv: torch.Tensor  # [num_tokens, q_size + 2 * kv_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
