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
into packed parameters (layers/packed_experts.py: float, FP8 blocks or int4 as they ship),
`experts.gate_up_proj` [E + S, 2 * I, H] (shard (e, 0) gate, (e, 1) up) and `experts.down_proj`
[E + S, H, I] (shard e), through `expert_weight_rules`. The S shared
experts (`mlp.shared_experts.*`, one MLP of S * I in the checkpoint) are cut into S experts of I
packed after the routed ones, and the router appends them to every token's choice with weight 1:
one grouped kernel pair then runs routed and shared experts together (on the H200 the shared MLP
as two more cuBLAS GEMMs and an activation was a sizeable share of a V2-Lite decode step; docs/
perf-log.md). The torch forward
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

Low precision (issue 25; `fp8_block` / `int4_group`, from ModelOptions): FP8 checkpoints hold the
routed and shared experts (packed together) and the dense projections in FP8; int4 checkpoints
(Kimi-K2.5) hold the routed experts in int4 and the shared experts in bf16, as `shared_experts`
apart from the packed routed ones (their output is added by the expert kernels).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.linear import Linear, MergedLinear
from foretell.layers.parallel_linear import row_parallel_linear
from foretell.layers.packed_experts import PackedExperts, expert_weight_rules  # noqa: F401 (models import them here)
from foretell.layers.rank_slices import RankSlice
from foretell.layers.weight_loaders import make_param
from foretell.ops.moe.dispatch import route
from foretell.ops.moe.reference import RouterConfig


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into gate_up_proj (shards 0, 1).

    With tp: gate_up column-parallel, down row-parallel (summed over ranks), or with
    reduce=False this rank's partial sum (bias-free: the caller sums it with others)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, dtype=None, device=None,
                 tp: TensorParallel | None = None, reduce: bool = True, fp8_block: tuple[int, int] | None = None):
        super().__init__()
        kw = dict(dtype=dtype, device=device, fp8_block=fp8_block)
        tp = tp or TensorParallel()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias, tp=tp, **kw)
        if reduce or not tp.is_parallel:
            self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias, tp=tp, **kw)
        else:
            if bias:
                raise ValueError("a partial (unreduced) MLP has no down_proj bias")
            start, part = tp.even_shard(intermediate_size, "the shared experts' intermediate size")
            self.down_proj = Linear(part, hidden_size, **kw)
            self.down_proj.set_weight_rank_slices({None: RankSlice(1, start, part, intermediate_size)}, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        return self.down_proj(self.gate_up_proj.forward_gated(x))  # silu(gate) * up: gate_up's epilogue


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] and, for noaux_tc, e_score_correction_bias [E]; both kept in
    float32 so routing decisions do not depend on the model dtype (as transformers does)."""

    # Set per instance by layers/batch_invariant.py (ModelConfig.batch_invariant); never changed here.
    batch_invariant = False

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
        return route(hidden, self.weight, self.config, self.e_score_correction_bias, self.route_counter,
                     self.batch_invariant)


class MoE(nn.Module):
    """Routed experts plus the shared experts (`mlp.gate`, `mlp.experts`, `mlp.shared_experts`),
    all packed in `experts` (the router appends the shared ones to every token's choice); under
    expert parallelism the shared ones are `shared_experts` (see the module docstring)."""

    def __init__(self, config: RouterConfig, hidden_size: int, moe_intermediate_size: int, *, dtype=None, device=None,
                 tp: TensorParallel | None = None, expert_parallel: bool = False,
                 fp8_block: tuple[int, int] | None = None, int4_group: int | None = None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        quant = dict(fp8_block=fp8_block, int4_group=int4_group)
        self.tp = tp or TensorParallel()
        self.expert_parallel = expert_parallel and self.tp.is_parallel
        self.shared_experts = None
        # Shared experts apart from the packed routed ones: under expert parallelism (their split
        # differs) and beside int4 experts (the shared ones stay bf16).
        shared_apart = self.expert_parallel or int4_group is not None
        if self.expert_parallel:
            self.first_expert, held = expert_shard(config.num_experts, self.tp)
            self.experts = PackedExperts(held, hidden_size, moe_intermediate_size, first_expert=self.first_expert,
                                         **kw, **quant)
        else:
            self.experts = PackedExperts(config.num_experts, hidden_size, moe_intermediate_size,
                                         0 if shared_apart else config.num_shared_experts, split_over=self.tp,
                                         **kw, **quant)
        self.gate = Router(replace(config, num_shared_experts=0) if shared_apart else config, hidden_size,
                           device=device)
        if shared_apart and config.num_shared_experts:
            self.shared_experts = GatedMLP(hidden_size, config.num_shared_experts * moe_intermediate_size,
                                           tp=self.tp, reduce=False, **kw,
                                           fp8_block=fp8_block if int4_group is None else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(hidden)  # [T, top_k (+ num_shared when packed)] each
        if self.expert_parallel:
            weights, ids = self.own_pairs(weights, ids)
        # [T, H]: the shared MLP held apart (under TP this rank's part of it), added by the experts
        shared = self.shared_experts(hidden) if self.shared_experts is not None else None
        out = self.experts(hidden, weights, ids, shared)  # [T, H]
        return self.tp.all_reduce(out) if self.tp.is_parallel else out

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
