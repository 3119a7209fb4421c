"""Linear layers: Linear, and the fused q/k/v (QKVLinear) and gate_up (MergedLinear) projections.

Their parameters know how checkpoint tensors fill them: each carries a `weight_loader` hook
(weight_loaders.py: the whole tensor for an unfused parameter, one named slice per checkpoint
tensor for a fused one, converted by value and shape-checked).

A Linear computes F.linear, or, once prepare_small_m_linears (small_m.py) has bound a
SmallMGemm to it (on CUDA, before graph capture), lets that pick cuBLAS or the Triton GEMV for
few-row inputs; with none bound, 2 to 8 float32 rows on the CPU take W x^T (cpu_few_rows.py: a
verify's rows at the cost of about one row); `MergedLinear.forward_gated` is an MLP's gate_up
projection with its activation, which those kernels apply as their epilogue.

Tensor parallelism (a TensorParallel with several ranks, distributed/tensor_parallel.py): the
fused q/k/v and gate_up layers and ColumnParallelLinear (parallel_linear.py) hold this rank's rows
of the output (no collective: their consumer works on its heads or columns); RowParallelLinear
holds its columns of the input and sums the partial products over ranks. Such parameters also
carry `rank_slices` (shard id -> RankSlice, rank_slices.py): which part of each checkpoint tensor
this rank holds, so the loader reads only that part and the weight_loader gets it already cut.
With one rank (the default) the layers are exactly the unsplit ones and carry no rank_slices.

FP8 (`fp8_block` (rows, columns), issue 25): the layer holds `weight` in float8_e4m3fn as an FP8
block-quantized checkpoint ships it, with float32 `weight_scale_inv` [ceil(out / rows), ceil(in /
columns)], and computes through ops/gemm/fp8_dispatch.fp8_linear. Both are copied bit for bit (a
float tensor for an FP8 weight is an error, not a conversion). A fused layer stacks its shards'
blocks, so every shard but the last must fill whole blocks (`fp8_fits`; else the layer stays in
the model dtype and the loader dequantizes its tensors). Tensor-parallel slices must cut along
block boundaries (`block_slices`, rank_slices.py, checked at construction). `quantize_fp8_` turns
a loaded float layer into the same layout (`quantization="fp8"`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.cpu_few_rows import few_rows_linear, fits_few_rows
from foretell.layers.rank_slices import RankSlice, block_slices, even_slices, kv_head_shard, set_rank_slices
from foretell.layers.weight_loaders import make_param, make_sharded_param, mark_fp8_dummy
from foretell.ops.gemm.fp8_dispatch import fp8_linear
from foretell.ops.gemm.fp8_reference import FP8_DTYPE, blocks, quantize_fp8_blocks
from foretell.ops.pointwise.dispatch import silu_and_mul

if TYPE_CHECKING:
    from foretell.ops.gemm.dispatch import SmallMGemm


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


def fp8_fits(shard_sizes: Sequence[int], block_rows: int) -> bool:
    """Whether shards stacked along the rows keep whole blocks: every shard but the last fills
    whole `block_rows`-row blocks (the last may end in a partial one)."""
    return all(size % block_rows == 0 for size in list(shard_sizes)[:-1])


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
