"""Mixture of experts as DeepSeek-V2/V3 and Kimi-K2 build it: a router, routed experts packed
into [num_experts, ...] parameters, and shared experts that every token goes through.

Routing (`RouterConfig`, `select_experts`: ops/moe/reference.py), in float32 whatever the model dtype:
  scores = sigmoid(logits) (V3, Kimi) or softmax(logits) (V2)
  choice = scores + e_score_correction_bias      (topk_method "noaux_tc"; bias only selects)
  with n_group > 1 only topk_group groups stay eligible; a group's score is the sum of its top 2
  choices ("noaux_tc") or its best score ("group_limited_greedy")
  experts = top-k of choice; weights = scores at those experts (unbiased),
            / their sum when norm_topk_prob, * routed_scaling_factor
On CUDA (triton installed, no autograd) ungrouped routing runs as one Triton kernel instead
(ops/moe/dispatch.py picks; `select_experts_triton` in ops/moe/triton_router.py).

Experts are stored per expert in checkpoints (`mlp.experts.{e}.gate_proj.weight`, ...). They load
into two packed parameters, `experts.gate_up_proj` [E + S, 2 * I, H] (shard (e, 0) gate, (e, 1)
up) and `experts.down_proj` [E + S, H, I] (shard e), through `expert_weight_rules`. The S shared
experts (`mlp.shared_experts.*`, one MLP of S * I in the checkpoint) are cut into S experts of I
packed after the routed ones, and the router appends them to every token's choice with weight 1:
one grouped kernel pair then runs routed and shared experts together (on the H200 the shared MLP
as two more cuBLAS GEMMs and an activation cost V2-Lite about 15% of a decode step). The torch forward
sorts the (token, expert) pairs by expert and runs one matmul pair per expert that has tokens
(a host loop: the CPU path and the reference). On CUDA, with triton installed and no autograd,
`PackedExperts` runs the fused kernels of ops/moe/triton_experts.py instead (ops/moe/dispatch.py):
same layout, no host sync, CUDA graph capturable.

Tensor parallel (a TensorParallel of several ranks): tokens are whole on every rank, and each rank
returns a partial sum that ONE all-reduce per layer completes. Two ways to split:
  inside each expert (the default)  every rank holds every expert, routed and shared, with its
      share of the intermediate size: gate/up rows [r * I/n, (r+1) * I/n), down's columns alike;
      the shared MLP (S * I wide) gives rank r its contiguous S * I/n rows, cut into S packed
      experts of I/n (any split of an MLP's intermediate units sums to the same output).
  expert parallel                   rank r holds routed experts [r * E/n, (r+1) * E/n) whole;
      every rank routes every token over all E, keeps only its own (token, expert) pairs (the
      others get weight 0 on its slot 0), and adds the shared MLP split as above
      (`shared_experts`, a separate gate_up/down pair since its width differs from the routed
      experts'); the other ranks' experts are never read from the checkpoint
      (`other_ranks_experts_pattern`). No all-to-all: tokens are already on every rank.
With one rank the layers are exactly the unsplit ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.linear import (
    Linear, MergedLinear, RankSlice, check_shape, make_param, row_parallel_linear, set_rank_slices,
)
from foretell.ops.moe.dispatch import fused_experts, route
from foretell.ops.moe.reference import RouterConfig
from foretell.weight_rules import WeightRule

class PackedExpertsLoader:
    """weight_loader of the packed expert parameters: shard (e, j) fills rows j*I .. (j+1)*I of
    expert e of gate_up_proj; shard e fills expert e of down_proj. The shared experts' tensors
    (shard ("shared", j) of gate_up_proj: [num_shared * I, H]; "shared" of down_proj:
    [H, num_shared * I]) are cut into num_shared experts of I, after the routed ones."""

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
            param[expert].narrow(0, part * rows, rows).copy_(loaded.to(param.dtype))

    def _load_shared(self, param: nn.Parameter, loaded: torch.Tensor, part: int) -> None:
        n, first = self.num_shared, self.num_experts
        if self.parts == 1:  # down_proj [H, n * I]: expert c takes columns c*I ..
            inter = param.shape[2]
            check_shape(loaded, (param.shape[1], n * inter), "shared experts' down_proj")
            with torch.no_grad():
                for c in range(n):
                    param[first + c].copy_(loaded[:, c * inter : (c + 1) * inter].to(param.dtype))
            return
        rows = param.shape[1] // self.parts  # gate_up [n * I, H] per part: expert c takes rows c*I ..
        check_shape(loaded, (n * rows, param.shape[2]), f"shared experts' part {part}")
        with torch.no_grad():
            for c in range(n):
                param[first + c].narrow(0, part * rows, rows).copy_(loaded[c * rows : (c + 1) * rows].to(param.dtype))


def _packed_param(shape, parts: int, num_shared: int, dtype, device, first_expert: int = 0) -> nn.Parameter:
    param = make_param(shape, dtype, device)
    loader = PackedExpertsLoader(shape[0] - num_shared, parts, num_shared, first_expert)
    param.weight_loader = loader
    param.shard_ids = loader.shard_ids()
    return param


def _intermediate_slices(loader: PackedExpertsLoader, dim: int, inter: int, tp: TensorParallel) -> dict[Any, RankSlice]:
    """shard id -> this rank's share of each checkpoint tensor's intermediate dim (rows of gate and
    up, dim 0; columns of down, dim 1): I/n of a routed expert's I, S*I/n of the shared MLP's S*I."""
    slices = {}
    for shard_id in loader.shard_ids():
        shared = shard_id == "shared" or (isinstance(shard_id, tuple) and shard_id[0] == "shared")
        whole = inter * loader.num_shared if shared else inter
        start, part = tp.even_shard(whole, "moe_intermediate_size")
        slices[shard_id] = RankSlice(dim, start, part, whole)
    return slices


class PackedExperts(nn.Module):
    """The routed experts, then `num_shared` shared experts of the same size, packed.

    Tensor parallel: `first_expert` is the checkpoint id of the first routed expert held (expert
    parallel: this rank's block), and with `split_over` (a TensorParallel of several ranks) each
    expert holds this rank's share of intermediate_size (the whole expert's, given here)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, num_shared: int = 0,
                 *, first_expert: int = 0, split_over: TensorParallel | None = None, dtype=None, device=None):
        super().__init__()
        self.num_experts = num_experts  # routed, held here
        self.num_shared = num_shared
        slots = num_experts + num_shared
        inter = intermediate_size
        if split_over is not None and split_over.is_parallel:
            inter = split_over.even_shard(intermediate_size, "moe_intermediate_size")[1]
        self.gate_up_proj = _packed_param((slots, 2 * inter, hidden_size), 2, num_shared, dtype, device, first_expert)
        self.down_proj = _packed_param((slots, hidden_size, inter), 1, num_shared, dtype, device, first_expert)
        if split_over is not None and split_over.is_parallel:
            for param, dim in ((self.gate_up_proj, 0), (self.down_proj, 1)):
                slices = _intermediate_slices(param.weight_loader, dim, intermediate_size, split_over)
                set_rank_slices(param, slices, split_over)

    def forward(self, hidden, weights, ids, shared=None):  # [T, H], [T, k], [T, k], [T, H] -> [T, H]
        """The routed experts' weighted sum plus `shared` (the shared experts' output), summed in
        float32 and returned in hidden's dtype."""
        return fused_experts(hidden, self.gate_up_proj, self.down_proj, weights, ids, shared)

    def extra_repr(self) -> str:
        _, two_i, h = self.gate_up_proj.shape
        return f"experts={self.num_experts}, shared={self.num_shared}, hidden={h}, intermediate={two_i // 2}"


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into gate_up_proj (shards 0, 1).

    With tp: gate_up column-parallel, down row-parallel (summed over ranks), or with
    reduce=False this rank's partial sum (bias-free: the caller sums it with others)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, dtype=None, device=None,
                 tp: TensorParallel | None = None, reduce: bool = True):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        tp = tp or TensorParallel()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias, tp=tp, **kw)
        if reduce or not tp.is_parallel:
            self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias, tp=tp, **kw)
        else:
            if bias:
                raise ValueError("a partial (unreduced) MLP has no down_proj bias")
            start, part = tp.even_shard(intermediate_size, "the shared experts' intermediate size")
            self.down_proj = Linear(part, hidden_size, **kw)
            set_rank_slices(self.down_proj.weight, {None: RankSlice(1, start, part, intermediate_size)}, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        return self.down_proj(self.gate_up_proj.forward_gated(x))  # silu(gate) * up: gate_up's epilogue


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] and, for noaux_tc, e_score_correction_bias [E]; both kept in
    float32 so routing decisions do not depend on the model dtype (as transformers does)."""

    def __init__(self, config: RouterConfig, hidden_size: int, *, device=None):
        super().__init__()
        self.config = config
        self.weight = make_param((config.num_experts, hidden_size), torch.float32, device)
        if config.uses_correction_bias:
            self.e_score_correction_bias = make_param((config.num_experts,), torch.float32, device)
        else:
            self.e_score_correction_bias = None
        # For the one-launch Triton routing (route_triton): its programs count themselves here; the
        # last resets it. Not a weight (not in the state dict); a CUDA graph captures its address.
        self.register_buffer("route_counter", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(hidden, self.weight, self.config, self.e_score_correction_bias, self.route_counter)


class MoE(nn.Module):
    """Routed experts plus the shared experts (`mlp.gate`, `mlp.experts`, `mlp.shared_experts`),
    all packed in `experts` (the router appends the shared ones to every token's choice); under
    expert parallelism the shared ones are `shared_experts` (see the module docstring)."""

    def __init__(self, config: RouterConfig, hidden_size: int, moe_intermediate_size: int, *, dtype=None, device=None,
                 tp: TensorParallel | None = None, expert_parallel: bool = False):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.tp = tp or TensorParallel()
        self.expert_parallel = expert_parallel and self.tp.is_parallel
        self.shared_experts = None
        if self.expert_parallel:
            self.first_expert, held = expert_shard(config.num_experts, self.tp)
            self.gate = Router(replace(config, num_shared_experts=0), hidden_size, device=device)
            self.experts = PackedExperts(held, hidden_size, moe_intermediate_size, first_expert=self.first_expert, **kw)
            if config.num_shared_experts:
                self.shared_experts = GatedMLP(hidden_size, config.num_shared_experts * moe_intermediate_size,
                                               tp=self.tp, reduce=False, **kw)
        else:
            self.gate = Router(config, hidden_size, device=device)
            self.experts = PackedExperts(config.num_experts, hidden_size, moe_intermediate_size,
                                         config.num_shared_experts, split_over=self.tp, **kw)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(hidden)  # [T, top_k + num_shared] each
        if not self.tp.is_parallel:
            return self.experts(hidden, weights, ids)
        shared = None
        if self.expert_parallel:
            weights, ids = self.own_pairs(weights, ids)
            if self.shared_experts is not None:
                shared = self.shared_experts(hidden)  # [T, H]: this rank's part of the shared MLP
        return self.tp.all_reduce(self.experts(hidden, weights, ids, shared))  # [T, H]

    def own_pairs(
        self, weights: torch.Tensor, ids: torch.Tensor  # [T, top_k] float32, int64 (global ids)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, top_k] each, ids of this rank's slots
        """Expert parallel: the (token, expert) pairs of other ranks' experts get weight 0 on slot 0
        (adding an exact 0.0), so the expert kernels keep their fixed shapes."""
        local = ids - self.first_expert
        elsewhere = (local < 0) | (local >= self.experts.num_experts)
        return weights.masked_fill(elsewhere, 0.0), local.masked_fill(elsewhere, 0)


def expert_shard(num_experts: int, tp: TensorParallel) -> tuple[int, int]:
    """(first routed expert, experts) this rank holds under expert parallelism."""
    return tp.even_shard(num_experts, "n_routed_experts (split by enable_expert_parallel)")


def other_ranks_experts_pattern(num_experts: int, tp: TensorParallel) -> str:
    """A regex of the checkpoint keys of routed experts another rank holds (expert parallel), for
    the ignore list: they are never read."""
    first, held = expert_shard(num_experts, tp)
    own = "|".join(str(e) for e in range(first, first + held))
    return rf"\.mlp\.experts\.(?!(?:{own})\.)\d+\."


def expert_weight_rules(pack_shared: bool = True) -> list[WeightRule]:
    """Per-expert checkpoint tensors -> the packed parameters (match before the plain gate/up
    rules, which would otherwise claim `experts.{e}.gate_proj`). With pack_shared False (expert
    parallel) the shared experts are left to those plain rules (`shared_experts.gate_up_proj`)."""
    shared = [
        WeightRule(r"\.shared_experts\.gate_proj\.weight$", ".experts.gate_up_proj", ("shared", 0)),
        WeightRule(r"\.shared_experts\.up_proj\.weight$", ".experts.gate_up_proj", ("shared", 1)),
        WeightRule(r"\.shared_experts\.down_proj\.weight$", ".experts.down_proj", "shared"),
    ]
    return (shared if pack_shared else []) + [
        WeightRule(r"\.experts\.(\d+)\.gate_proj\.weight$", ".experts.gate_up_proj",
                   lambda m: (int(m.group(1)), 0)),
        WeightRule(r"\.experts\.(\d+)\.up_proj\.weight$", ".experts.gate_up_proj",
                   lambda m: (int(m.group(1)), 1)),
        WeightRule(r"\.experts\.(\d+)\.down_proj\.weight$", ".experts.down_proj",
                   lambda m: int(m.group(1))),
    ]
