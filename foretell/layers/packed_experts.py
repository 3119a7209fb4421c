"""The routed experts of a MoE layer packed into [slots, ...] parameters, in the precision the
checkpoint ships them, and the rules that route per-expert checkpoint tensors into them.

Checkpoints store experts one by one (`mlp.experts.{e}.gate_proj.weight`, ...). They load into
packed parameters through `expert_weight_rules`, expert e's gate rows then up rows in
gate_up, shard (e, 0) and (e, 1); down shard e. Three formats (`PackedExperts.format`):
  float  `gate_up_proj` [slots, 2 * I, H] and `down_proj` [slots, H, I] in the model dtype;
  fp8    the same two in float8_e4m3fn with float32 block scales `gate_up_proj_scale_inv`
         [slots, 2 * I / b0, ceil(H / b1)] and `down_proj_scale_inv` [slots, ceil(H / b0), I / b1]
         from each expert's `weight_scale_inv` (DeepSeek-V3/R1, Kimi-K2; I must fill whole
         blocks, else the experts stay float and the loader dequantizes them);
  int4   compressed-tensors pack-quantized (Kimi-K2.5's routed experts, ops/moe/int4_reference.py):
         `gate_up_proj_packed` int32 [slots, 2 * I, ceil(H / 8)], `gate_up_proj_scale` [slots,
         2 * I, ceil(H / 32)], `down_proj_packed` [slots, H, ceil(I / 8)], `down_proj_scale`
         [slots, H, ceil(I / 32)] from `weight_packed` / `weight_scale`; `weight_shape` is ignored
         (the packed shapes are checked instead).
The S shared experts (`mlp.shared_experts.*`, one MLP of S * I) can be packed after the routed
ones (float and fp8: the shared MLP is cut into S experts of I) so one grouped kernel pair runs
both; int4 checkpoints keep their shared experts in bf16, so there the MoE holds them apart.

Split inside each expert over tensor-parallel ranks (`split_over`): each rank holds its share of
I of every expert (gate/up rows, down columns, and the matching rows or columns of scales and
packed words); the cut must fall on FP8 blocks or int4 groups, checked here with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.rank_slices import RankSlice, set_rank_slices
from foretell.layers.weight_loaders import as_param_dtype, check_shape, make_param, mark_fp8_dummy
from foretell.ops.gemm.fp8_reference import FP8_DTYPE, blocks, quantize_fp8_blocks
from foretell.ops.moe.dispatch import fused_experts
from foretell.ops.moe.fp8_dispatch import fused_fp8_experts
from foretell.ops.moe.int4_dispatch import fused_int4_experts
from foretell.ops.moe.int4_reference import INT4_GROUP, PACK, groups, words
from foretell.weight_rules import WeightRule

# Dummy int4 scales: random nibbles (-8..7, std ~4.6) times this give the float experts' spread.
INT4_DUMMY_SCALE = 0.005


class PackedExpertsLoader:
    """weight_loader of the packed expert parameters: shard (e, j) fills rows j*R .. (j+1)*R of
    expert e of a gate_up parameter (R its rows per part); shard e fills expert e of a down one.
    The shared experts' tensors (shard ("shared", j) of gate_up: [num_shared * R, C]; "shared" of
    down: [C, num_shared * W]) are cut into num_shared experts, after the routed ones."""

    def __init__(self, num_experts: int, parts: int, num_shared: int = 0, first_expert: int = 0):
        self.num_experts = num_experts  # routed, held here
        self.parts = parts
        self.num_shared = num_shared
        self.first_expert = first_expert  # the checkpoint's id of slot 0 (expert parallel)

    def shard_ids(self) -> tuple[Any, ...]:
        held = range(self.first_expert, self.first_expert + self.num_experts)
        if self.parts == 1:
            return tuple(held) + (("shared",) if self.num_shared else ())
        routed = tuple((e, j) for e in held for j in range(self.parts))
        return routed + tuple(("shared", j) for j in range(self.parts) if self.num_shared)

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if self.parts == 1:
            expert, part = shard_id, 0
        else:
            expert, part = shard_id if isinstance(shard_id, tuple) else (None, None)
        if expert == "shared" and self.num_shared and 0 <= part < self.parts:
            return self._load_shared(param, loaded, part)
        if isinstance(expert, int):
            expert -= self.first_expert
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts or not 0 <= part < self.parts:
            held = f" (from expert {self.first_expert})" if self.first_expert else ""
            raise ValueError(f"packed experts parameter of {self.num_experts} experts{held} got shard {shard_id!r}")
        rows = param.shape[1] // self.parts
        check_shape(loaded, (rows, param.shape[2]), f"expert {expert}")
        with torch.no_grad():
            param[expert].narrow(0, part * rows, rows).copy_(as_param_dtype(loaded, param))

    def _load_shared(self, param: nn.Parameter, loaded: torch.Tensor, part: int) -> None:
        n, first = self.num_shared, self.num_experts
        if self.parts == 1:  # down [H, n * I]: expert c takes columns c*I ..
            inter = param.shape[2]
            check_shape(loaded, (param.shape[1], n * inter), "shared experts' down_proj")
            loaded = as_param_dtype(loaded, param)
            with torch.no_grad():
                for c in range(n):
                    param[first + c].copy_(loaded[:, c * inter : (c + 1) * inter])
            return
        rows = param.shape[1] // self.parts  # gate_up [n * I, H] per part: expert c takes rows c*I ..
        check_shape(loaded, (n * rows, param.shape[2]), f"shared experts' part {part}")
        loaded = as_param_dtype(loaded, param)
        with torch.no_grad():
            for c in range(n):
                param[first + c].narrow(0, part * rows, rows).copy_(loaded[c * rows : (c + 1) * rows])


def _packed_param(shape, parts: int, num_shared: int, dtype, device, first_expert: int = 0) -> nn.Parameter:
    param = make_param(shape, dtype, device)
    loader = PackedExpertsLoader(shape[0] - num_shared, parts, num_shared, first_expert)
    param.weight_loader = loader
    param.shard_ids = loader.shard_ids()
    return param


def _intermediate_slices(loader: PackedExpertsLoader, dim: int, units: int, tp: TensorParallel) -> dict[Any, RankSlice]:
    """shard id -> this rank's share of each checkpoint tensor's intermediate dim (rows of gate and
    up, dim 0; columns of down, dim 1), counted in `units` per expert (I, or I's blocks, words or
    groups): units/n of a routed expert's, S*units/n of the shared MLP's."""
    slices = {}
    for shard_id in loader.shard_ids():
        shared = shard_id == "shared" or (isinstance(shard_id, tuple) and shard_id[0] == "shared")
        whole = units * loader.num_shared if shared else units
        start, part = tp.even_shard(whole, "moe_intermediate_size")
        slices[shard_id] = RankSlice(dim, start, part, whole)
    return slices


def expert_format(intermediate_size: int, tp: TensorParallel | None, fp8_block: tuple[int, int] | None,
                  int4_group: int | None) -> str:
    """"int4", "fp8" or "float" for experts of this intermediate size; ValueError where tensor
    parallelism would cut inside an FP8 block or an int4 group."""
    n = tp.world_size if tp is not None and tp.is_parallel else 1
    part = intermediate_size // n
    if int4_group is not None:
        if int4_group != INT4_GROUP:
            raise ValueError(f"int4 experts are read in groups of {INT4_GROUP} columns; the checkpoint's "
                             f"quantization_config says group_size {int4_group}")
        if n > 1 and part % INT4_GROUP:
            raise ValueError(f"moe_intermediate_size = {intermediate_size} split over tensor_parallel_size = {n} gives "
                             f"{part} columns of int4 down_proj per rank, not a multiple of its {INT4_GROUP}-column "
                             f"scale groups; choose a tensor_parallel_size whose share is, or enable_expert_parallel")
        return "int4"
    if fp8_block is None or intermediate_size % fp8_block[0] or intermediate_size % fp8_block[1]:
        return "float"  # (an FP8 checkpoint's experts are then dequantized at load)
    if n > 1 and (part % fp8_block[0] or part % fp8_block[1]):
        raise ValueError(f"moe_intermediate_size = {intermediate_size} split over tensor_parallel_size = {n} gives "
                         f"{part} per rank, which cuts inside the FP8 checkpoint's {list(fp8_block)} blocks; choose "
                         f"a tensor_parallel_size whose share is a multiple of the block, or enable_expert_parallel")
    return "fp8"


class PackedExperts(nn.Module):
    """The routed experts, then `num_shared` shared experts of the same size, packed.

    Tensor parallel: `first_expert` is the checkpoint id of the first routed expert held (expert
    parallel: this rank's block), and with `split_over` (a TensorParallel of several ranks) each
    expert holds this rank's share of intermediate_size (the whole expert's, given here).
    `fp8_block` / `int4_group`: the checkpoint's format (module docstring)."""

    # Set per instance by layers/batch_invariant.py (ModelConfig.batch_invariant): float experts then
    # sum in a fixed order (ops/moe/batch_invariant.py). Never changed here.
    batch_invariant = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, num_shared: int = 0,
                 *, first_expert: int = 0, split_over: TensorParallel | None = None, dtype=None, device=None,
                 fp8_block: tuple[int, int] | None = None, int4_group: int | None = None):
        super().__init__()
        self.num_experts = num_experts  # routed, held here
        self.num_shared = num_shared
        self.format = expert_format(intermediate_size, split_over, fp8_block, int4_group)
        if self.format == "int4" and num_shared:
            raise ValueError("int4 experts are routed experts only: keep the (bf16) shared experts apart")
        self.block_size = fp8_block if self.format == "fp8" else None
        split = split_over is not None and split_over.is_parallel
        inter = split_over.even_shard(intermediate_size, "moe_intermediate_size")[1] if split else intermediate_size
        self.hidden_size, self.intermediate_size = hidden_size, inter  # this rank's
        slots, h = num_experts + num_shared, hidden_size
        full = intermediate_size

        def packed(name, shape, parts, param_dtype, dim, units):
            param = _packed_param(shape, parts, num_shared, param_dtype, device, first_expert)
            self.register_parameter(name, param)
            if split:
                set_rank_slices(param, _intermediate_slices(param.weight_loader, dim, units, split_over), split_over)
            return param

        if self.format == "int4":
            packed("gate_up_proj_packed", (slots, 2 * inter, words(h)), 2, torch.int32, 0, full).dummy_random_bits = True
            packed("gate_up_proj_scale", (slots, 2 * inter, groups(h)), 2, dtype, 0, full).dummy_value = INT4_DUMMY_SCALE
            packed("down_proj_packed", (slots, h, words(inter)), 1, torch.int32, 1, full // PACK).dummy_random_bits = True
            packed("down_proj_scale", (slots, h, groups(inter)), 1, dtype, 1, full // INT4_GROUP).dummy_value = INT4_DUMMY_SCALE
            return
        weight_dtype = FP8_DTYPE if self.format == "fp8" else dtype
        packed("gate_up_proj", (slots, 2 * inter, h), 2, weight_dtype, 0, full)
        packed("down_proj", (slots, h, inter), 1, weight_dtype, 1, full)
        if self.format == "fp8":
            b0, b1 = self.block_size
            packed("gate_up_proj_scale_inv", (slots, 2 * inter // b0, blocks(h, b1)), 2, torch.float32, 0, full // b0)
            packed("down_proj_scale_inv", (slots, blocks(h, b0), inter // b1), 1, torch.float32, 1, full // b1)
            mark_fp8_dummy(self.gate_up_proj, self.gate_up_proj_scale_inv)
            mark_fp8_dummy(self.down_proj, self.down_proj_scale_inv)

    def forward(self, hidden, weights, ids, shared=None):  # [T, H], [T, k], [T, k], [T, H] -> [T, H]
        """The routed experts' weighted sum plus `shared` (the shared experts' output), summed in
        float32 and returned in hidden's dtype."""
        if self.format == "fp8":
            return fused_fp8_experts(hidden, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                                     self.down_proj_scale_inv, self.block_size, weights, ids, shared)
        if self.format == "int4":
            return fused_int4_experts(hidden, self.gate_up_proj_packed, self.gate_up_proj_scale, self.down_proj_packed,
                                      self.down_proj_scale, weights, ids, shared)
        return fused_experts(hidden, self.gate_up_proj, self.down_proj, weights, ids, shared, self.batch_invariant)

    @torch.no_grad()
    def quantize_fp8_(self, block: tuple[int, int]) -> None:
        """Loaded float experts into FP8 blocks per expert (`quantization="fp8"`); the float
        weights are freed."""
        if self.format != "float":
            return
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            parts = [quantize_fp8_blocks(weight[e], block) for e in range(weight.shape[0])]
            setattr(self, name, nn.Parameter(torch.stack([q for q, _ in parts]), requires_grad=False))
            setattr(self, name + "_scale_inv", nn.Parameter(torch.stack([s for _, s in parts]), requires_grad=False))
        self.format, self.block_size = "fp8", tuple(block)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, shared={self.num_shared}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, format={self.format}")


# checkpoint suffix -> packed parameter suffix, per format
_SUFFIXES = {"weight": "", "weight_scale_inv": "_scale_inv", "weight_packed": "_packed", "weight_scale": "_scale"}
# Kimi-K2.5's per-expert `weight_shape` (int32 [2]): the packed shapes are checked instead.
INT4_SHAPE_KEYS = r"\.experts\.\d+\.(?:gate|up|down)_proj\.weight_shape$"


def expert_weight_rules(pack_shared: bool = True) -> list[WeightRule]:
    """Per-expert checkpoint tensors (weights, FP8 scales, int4 packed words and scales) -> the
    packed parameters (match before the plain gate/up rules, which would otherwise claim
    `experts.{e}.gate_proj`). With pack_shared False (expert parallel, int4 experts) the shared
    experts are left to those plain rules (`shared_experts.gate_up_proj`)."""
    rules = []
    for suffix, to in _SUFFIXES.items():
        if pack_shared and suffix in ("weight", "weight_scale_inv"):
            rules += [
                WeightRule(rf"\.shared_experts\.gate_proj\.{suffix}$", f".experts.gate_up_proj{to}", ("shared", 0)),
                WeightRule(rf"\.shared_experts\.up_proj\.{suffix}$", f".experts.gate_up_proj{to}", ("shared", 1)),
                WeightRule(rf"\.shared_experts\.down_proj\.{suffix}$", f".experts.down_proj{to}", "shared"),
            ]
        rules += [
            WeightRule(rf"\.experts\.(\d+)\.gate_proj\.{suffix}$", f".experts.gate_up_proj{to}",
                       lambda m: (int(m.group(1)), 0)),
            WeightRule(rf"\.experts\.(\d+)\.up_proj\.{suffix}$", f".experts.gate_up_proj{to}",
                       lambda m: (int(m.group(1)), 1)),
            WeightRule(rf"\.experts\.(\d+)\.down_proj\.{suffix}$", f".experts.down_proj{to}",
                       lambda m: int(m.group(1))),
        ]
    return rules
