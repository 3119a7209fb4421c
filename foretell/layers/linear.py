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
few-row inputs; with none bound, 2 to 8 float32 rows on the CPU take W x^T (cpu_few_rows.py: a
verify's rows at the cost of about one row); `MergedLinear.forward_gated` is an MLP's gate_up
projection with its activation, which those kernels apply as their epilogue.

Tensor parallelism (a TensorParallel with several ranks, distributed/tensor_parallel.py): the
fused q/k/v and gate_up layers and ColumnParallelLinear (parallel_linear.py) hold this rank's rows of the output (no
collective: their consumer works on its heads or columns); RowParallelLinear holds its columns of
the input and sums the partial products over ranks. Such parameters also carry `rank_slices`
(shard id -> RankSlice): which part of each checkpoint tensor this rank holds, so the loader
reads only that part and the weight_loader gets it already cut. With one rank (the default)
the layers are exactly the unsplit ones and carry no rank_slices.

FP8 (`fp8_block` (rows, columns), issue 25): the layer holds `weight` in float8_e4m3fn as an FP8
block-quantized checkpoint ships it, with float32 `weight_scale_inv` [ceil(out / rows), ceil(in /
columns)], and computes through ops/gemm/fp8_dispatch.fp8_linear. Both are copied bit for bit (a
float tensor for an FP8 weight is an error, not a conversion). A fused layer stacks its shards'
blocks, so every shard but the last must fill whole blocks (`fp8_fits`; else the layer stays in
the model dtype and the loader dequantizes its tensors). Tensor-parallel slices must cut along
block boundaries (`block_slices`, checked at construction). `quantize_fp8_` turns a loaded float
layer into the same layout (`quantization="fp8"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.cpu_few_rows import few_rows_linear, fits_few_rows
from foretell.ops.gemm.fp8_dispatch import fp8_linear
from foretell.ops.gemm.fp8_reference import FP8_DTYPE, blocks, quantize_fp8_blocks
from foretell.ops.pointwise.dispatch import silu_and_mul

if TYPE_CHECKING:
    from foretell.ops.gemm.dispatch import SmallMGemm


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


def fp8_fits(shard_sizes: Sequence[int], block_rows: int) -> bool:
    """Whether shards stacked along the rows keep whole blocks: every shard but the last fills
    whole `block_rows`-row blocks (the last may end in a partial one)."""
    return all(size % block_rows == 0 for size in list(shard_sizes)[:-1])


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


class Linear(nn.Module):
    """y = x W^T (+ b), W [output_size, input_size], loaded whole from one checkpoint tensor.

    With fp8_block, W is float8_e4m3fn with its block scales `weight_scale_inv` (module docstring)."""

    # Set per instance by prepare_small_m_linears; the class default (never changed) is F.linear.
    small_m: "SmallMGemm | None" = None
    # Whether the bias is added by the matmul (the small-M kernels are chosen with it); a
    # row-parallel layer adds it after the sum over ranks instead.
    bias_in_gemm = True
    # Whether quantization="fp8" may quantize it; False (set at construction) for a weight read
    # directly rather than through forward (MLA's kv_b_proj).
    quantizable = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fp8_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.block_size = fp8_block
        self.make_weight({None: output_size}, dtype, device)
        self.bias = make_param((output_size,), dtype, device) if bias else None

    def make_weight(self, shard_sizes: dict[Any, int], dtype, device) -> None:
        """`weight` (and with block_size, `weight_scale_inv`) for output rows stacked from the
        named shards (one unnamed shard: an unfused weight)."""
        fused = list(shard_sizes) != [None]
        block = self.block_size
        if block is None:
            self.weight = (make_sharded_param((self.input_size,), shard_sizes, dtype, device) if fused
                           else make_param((self.output_size, self.input_size), dtype, device))
            self.register_parameter("weight_scale_inv", None)
            return
        scale_sizes = {k: blocks(size, block[0]) for k, size in shard_sizes.items()}
        scale_cols = blocks(self.input_size, block[1])
        if fused:
            self.weight = make_sharded_param((self.input_size,), shard_sizes, FP8_DTYPE, device)
            self.weight_scale_inv = make_sharded_param((scale_cols,), scale_sizes, torch.float32, device)
        else:
            self.weight = make_param((self.output_size, self.input_size), FP8_DTYPE, device)
            self.weight_scale_inv = make_param((scale_sizes[None], scale_cols), torch.float32, device)
        mark_fp8_dummy(self.weight, self.weight_scale_inv)

    def set_weight_rank_slices(self, slices: dict[Any, RankSlice], tp: TensorParallel) -> None:
        """This rank's part of each checkpoint weight (and of its block scales, cut alike)."""
        set_rank_slices(self.weight, slices, tp)
        if self.weight_scale_inv is not None and tp.is_parallel:
            what = f"an FP8 layer of {self.output_size} x {self.input_size} on this rank"
            set_rank_slices(self.weight_scale_inv, block_slices(slices, self.block_size, what), tp)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.weight_scale_inv is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size, bias)
        if self.small_m is not None:
            return self.small_m(x, self.weight, bias)
        if fits_few_rows(x, self.weight):  # a CPU verify's rows: W x^T streams W once (cpu_few_rows.py)
            return few_rows_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input] -> [..., output]
        return self.matmul(x, self.bias)

    @torch.no_grad()
    def quantize_fp8_(self, block: tuple[int, int]) -> None:
        """A loaded float layer into FP8 blocks of `block` (`quantization="fp8"`): same forward,
        the weight read in 8 bits. The float weight is freed."""
        if self.is_fp8:
            return
        q, scale = quantize_fp8_blocks(self.weight.data, block)  # [out, in] fp8, [rows, cols] float32
        self.block_size = tuple(block)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.small_m = None

    def extra_repr(self) -> str:
        fp8 = "" if self.block_size is None else f", fp8 blocks {self.block_size[0]}x{self.block_size[1]}"
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{fp8}"


def fused_fp8_block(fp8_block: tuple[int, int] | None, shard_sizes: Sequence[int]) -> tuple[int, int] | None:
    """The block a fused layer of these output shards can hold in FP8: fp8_block if every shard
    but the last fills whole blocks, else None (the layer stays float; its FP8 tensors are
    dequantized at load)."""
    if fp8_block is None or not fp8_fits(shard_sizes, fp8_block[0]):
        return None
    return fp8_block


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
        fp8_block: tuple[int, int] | None = None,
    ):
        nn.Module.__init__(self)
        tp = tp or TensorParallel()
        slices = even_slices(dict(enumerate(output_sizes)), 0, tp, "a fused projection's output size")
        self.input_size = input_size
        self.output_sizes = tuple(s.size for s in slices.values())  # this rank's
        self.output_size = sum(self.output_sizes)
        self.block_size = fused_fp8_block(fp8_block, output_sizes)
        sizes = dict(enumerate(self.output_sizes))
        self.make_weight(sizes, dtype, device)
        self.bias = make_sharded_param((), sizes, dtype, device) if bias else None
        self.set_weight_rank_slices(slices, tp)
        set_rank_slices(self.bias, slices, tp)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:  # [..., input] -> [..., output // 2]
        """silu_and_mul(self(x)) for a [gate; up] projection (two equal parts): where the few-row
        kernels run the layer, the activation is their epilogue (no gate_up tensor, no launch)."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"forward_gated needs two equal parts (gate, up), this has {list(self.output_sizes)}")
        if self.is_fp8:  # the FP8 few-row kernels apply it in their epilogue too
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size, self.bias, gated=True)
        if self.small_m is not None:
            return self.small_m(x, self.weight, self.bias, gated=True)
        return silu_and_mul(self.matmul(x, self.bias))


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
        fp8_block: tuple[int, int] | None = None,
    ):
        nn.Module.__init__(self)
        tp = tp or TensorParallel()
        first_kv, self.num_kv_heads = kv_head_shard(num_heads, num_kv_heads, tp)
        first_q, self.num_heads = tp.even_shard(num_heads, "num_attention_heads")
        self.input_size = hidden_size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.output_size = self.q_size + 2 * self.kv_size
        full_kv = num_kv_heads * head_dim
        self.block_size = fused_fp8_block(fp8_block, [num_heads * head_dim, full_kv, full_kv])
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.make_weight(sizes, dtype, device)
        self.bias = make_sharded_param((), sizes, dtype, device) if bias else None
        kv_slice = RankSlice(0, first_kv * head_dim, self.kv_size, full_kv)
        slices = {"q": RankSlice(0, first_q * head_dim, self.q_size, num_heads * head_dim),
                  "k": kv_slice, "v": kv_slice}
        self.set_weight_rank_slices(slices, tp)
        set_rank_slices(self.bias, slices, tp)

    def split(
        self, qkv: torch.Tensor  # [num_tokens, q_size + 2 * kv_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
