"""Parameters that know how checkpoint tensors fill them: `make_param` and `make_sharded_param`,
and the weight_loader hooks they carry (the layers build their parameters with these).

Every parameter carries `weight_loader(param, loaded_tensor, shard_id)`, the hook the generic
loader calls. Unfused parameters take the whole tensor (shard_id None); fused ones take one named
slice per checkpoint tensor and list the slices they expect in `param.shard_ids`, so the loader can
tell a half-loaded fused parameter from a complete one.

Values are converted with `tensor.to(param.dtype)` (by value, never by reinterpreting bits), and a
tensor of the wrong shape raises ValueError with the expected and found shapes; the loader adds
the parameter name, checkpoint key and file. An FP8 parameter takes FP8 bits only (a float tensor
for an FP8 weight is an error, not a conversion: layers/linear.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from foretell.ops.gemm.fp8_reference import FP8_DTYPE


def check_shape(loaded: torch.Tensor, expected: Sequence[int], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{what}: expected shape {tuple(expected)}, found shape {tuple(loaded.shape)}"
        )


def as_param_dtype(loaded: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """loaded in param's dtype, converted by value; an FP8 parameter takes FP8 bits only (a float
    tensor there means the checkpoint does not hold this layer in FP8)."""
    if param.dtype == FP8_DTYPE and loaded.dtype != FP8_DTYPE:
        raise ValueError(f"expected a float8_e4m3fn tensor (the layer is held in FP8, as the checkpoint's "
                         f"quantization_config says), found {loaded.dtype}")
    return loaded.to(param.dtype)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole checkpoint tensor into an unfused parameter, converting dtype by value."""
    if shard_id is not None:
        raise ValueError(f"parameter is not fused but was given shard {shard_id!r}")
    check_shape(loaded, param.shape, "parameter")
    with torch.no_grad():
        param.copy_(as_param_dtype(loaded, param))


def make_param(
    shape: Sequence[int], dtype: torch.dtype | None, device: torch.device | str | None
) -> nn.Parameter:
    param = nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


# Dummy weights (load_format="dummy") of an FP8 layer: unit-normal FP8 values times this scale,
# so the real weight has the float layers' spread (loader.DUMMY_STD) without FP8 subnormals.
FP8_DUMMY_SCALE = 0.02


def mark_fp8_dummy(weight: nn.Parameter, scale: nn.Parameter) -> None:
    weight.dummy_std = 1.0
    scale.dummy_value = FP8_DUMMY_SCALE


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
            param.narrow(0, offset, size).copy_(as_param_dtype(loaded, param))


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
