"""Mixture of experts as DeepSeek-V2/V3 and Kimi-K2 build it: a router, routed experts packed
into [num_experts, ...] parameters, and shared experts that every token goes through.

Routing (`RouterConfig`, `select_experts`), computed in float32 whatever the model dtype:
  scores = sigmoid(logits) (V3, Kimi) or softmax(logits) (V2)
  choice = scores + e_score_correction_bias      (topk_method "noaux_tc"; bias only selects)
  with n_group > 1 only topk_group groups stay eligible; a group's score is the sum of its top 2
  choices ("noaux_tc") or its best score ("group_limited_greedy")
  experts = top-k of choice; weights = scores at those experts (unbiased),
            / their sum when norm_topk_prob, * routed_scaling_factor
On CUDA (triton installed, no autograd) ungrouped routing runs as one Triton kernel instead
(`select_experts_triton` in moe_router_triton.py, whose twin `select_experts` is).

Experts are stored per expert in checkpoints (`mlp.experts.{e}.gate_proj.weight`, ...). They load
into two packed parameters, `experts.gate_up_proj` [E + S, 2 * I, H] (shard (e, 0) gate, (e, 1)
up) and `experts.down_proj` [E + S, H, I] (shard e), through `expert_weight_rules`. The S shared
experts (`mlp.shared_experts.*`, one MLP of S * I in the checkpoint) are cut into S experts of I
packed after the routed ones, and the router appends them to every token's choice with weight 1:
one grouped kernel pair then runs routed and shared experts together (on the H200 the shared MLP
as two more cuBLAS GEMMs and an activation cost V2-Lite about 15% of a decode step). The torch forward
sorts the (token, expert) pairs by expert and runs one matmul pair per expert that has tokens
(a host loop: the CPU path and the reference). On CUDA, with triton installed and no autograd,
`PackedExperts` runs the fused kernels of moe_triton.py instead: same layout, no host sync, CUDA
graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foretell.layers.kernel_dispatch import use_triton
from foretell.layers.linear import Linear, MergedLinear, check_shape, make_param
from foretell.weight_rules import WeightRule

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Shared experts every token goes through: routed as experts num_experts .. + n - 1 with
    # weight 1 (unscaled) after the top_k, so they run inside the same grouped expert kernels.
    num_shared_experts: int = 0

    def __post_init__(self) -> None:
        if self.num_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported; expected one of "
                f"{', '.join(SCORING_FUNCS)}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method {self.topk_method!r} is not supported; expected one of "
                f"{', '.join(TOPK_METHODS)}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in [1, n_routed_experts="
                f"{self.num_experts}]"
            )
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"n_group {self.n_group} must divide n_routed_experts {self.num_experts}"
            )
        if self.grouped and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.grouped and self.topk_group * self.num_experts // self.n_group < self.top_k:
            raise ValueError(
                f"topk_group {self.topk_group} groups of {self.num_experts // self.n_group} "
                f"experts hold fewer than num_experts_per_tok={self.top_k} experts"
            )

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy" and self.n_group > 1

    @property
    def uses_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [num_experts] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] f32, ids [.., top_k] int64
    if config.scoring_func == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        scores = router_logits.softmax(dim=-1)
    choice = scores + correction_bias if correction_bias is not None else scores
    if config.grouped:
        num_tokens = choice.shape[0]
        grouped = choice.view(num_tokens, config.n_group, -1)  # [T, G, E / G]
        if config.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.amax(dim=-1)
        kept = group_scores.topk(config.topk_group, dim=-1).indices  # [T, topk_group]
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(config.top_k, dim=-1).indices  # [T, top_k]
    weights = scores.gather(1, ids)
    if config.norm_topk_prob and config.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return append_shared_experts(weights * config.routed_scaling_factor, ids, config)


def append_shared_experts(
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
    config: RouterConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k + num_shared_experts] each
    """Every token's shared experts after its routed ones: ids num_experts.., weight 1."""
    n = config.num_shared_experts
    if n == 0:
        return weights, ids
    num_tokens = ids.shape[0]
    shared_ids = torch.arange(config.num_experts, config.num_experts + n, device=ids.device)
    return (
        torch.cat([weights, weights.new_ones(num_tokens, n)], dim=1),
        torch.cat([ids, shared_ids.expand(num_tokens, n)], dim=1),
    )


def experts_forward_torch(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, hidden], float32 (summed over the top_k experts)
    """Group the (token, expert) pairs by expert; one gate_up / down matmul per used expert."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)  # pair indices grouped by expert
    tokens = order // top_k  # [num_tokens * top_k]
    pair_weights = weights.flatten()[order]
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()  # one host sync
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        x = hidden.index_select(0, rows)  # [count, hidden]
        gate, up = F.linear(x, gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])  # [count, hidden]
        out.index_add_(0, rows, y.float() * pair_weights[start : start + count, None])
        start += count
    return out


class PackedExpertsLoader:
    """weight_loader of the packed expert parameters: shard (e, j) fills rows j*I .. (j+1)*I of
    expert e of gate_up_proj; shard e fills expert e of down_proj. The shared experts' tensors
    (shard ("shared", j) of gate_up_proj: [num_shared * I, H]; "shared" of down_proj:
    [H, num_shared * I]) are cut into num_shared experts of I, after the routed ones."""

    def __init__(self, num_experts: int, parts: int, num_shared: int = 0):
        self.num_experts = num_experts  # routed
        self.parts = parts
        self.num_shared = num_shared

    def shard_ids(self) -> tuple[Any, ...]:
        if self.parts == 1:
            return tuple(range(self.num_experts)) + (("shared",) if self.num_shared else ())
        routed = tuple((e, j) for e in range(self.num_experts) for j in range(self.parts))
        return routed + tuple(("shared", j) for j in range(self.parts) if self.num_shared)

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if self.parts == 1:
            expert, part = shard_id, 0
        else:
            expert, part = shard_id if isinstance(shard_id, tuple) else (None, None)
        if expert == "shared" and self.num_shared and 0 <= part < self.parts:
            return self._load_shared(param, loaded, part)
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts or not 0 <= part < self.parts:
            raise ValueError(
                f"packed experts parameter of {self.num_experts} experts got shard {shard_id!r}"
            )
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


def _packed_param(shape, parts: int, num_shared: int, dtype, device) -> nn.Parameter:
    param = make_param(shape, dtype, device)
    loader = PackedExpertsLoader(shape[0] - num_shared, parts, num_shared)
    param.weight_loader = loader
    param.shard_ids = loader.shard_ids()
    return param


class PackedExperts(nn.Module):
    """The routed experts, then `num_shared` shared experts of the same size, packed."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, num_shared: int = 0,
                 *, dtype=None, device=None):
        super().__init__()
        self.num_experts = num_experts  # routed
        self.num_shared = num_shared
        slots = num_experts + num_shared
        self.gate_up_proj = _packed_param((slots, 2 * intermediate_size, hidden_size), 2, num_shared, dtype, device)
        self.down_proj = _packed_param((slots, hidden_size, intermediate_size), 1, num_shared, dtype, device)

    def forward(self, hidden, weights, ids, shared=None):  # [T, H], [T, k], [T, k], [T, H] -> [T, H]
        """The routed experts' weighted sum plus `shared` (the shared experts' output), summed in
        float32 and returned in hidden's dtype."""
        if use_triton(hidden, self.gate_up_proj):
            from foretell.layers.moe_triton import (
                fused_experts_triton,  # imports triton
            )

            return fused_experts_triton(hidden, self.gate_up_proj, self.down_proj, weights, ids,
                                        shared=shared, out_dtype=hidden.dtype)
        out = experts_forward_torch(hidden, self.gate_up_proj, self.down_proj, weights, ids)  # float32
        if shared is not None:
            out = out + shared  # float32 + model dtype: one promoting add
        return out.to(hidden.dtype)

    def extra_repr(self) -> str:
        _, two_i, h = self.gate_up_proj.shape
        return f"experts={self.num_experts}, shared={self.num_shared}, hidden={h}, intermediate={two_i // 2}"


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into gate_up_proj (shards 0, 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, **kw)

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
        if not use_triton(hidden):
            logits = F.linear(hidden.float(), self.weight)  # [T, E] float32
            return select_experts(logits, self.config, self.e_score_correction_bias)
        from foretell.layers import moe_router_triton as kernels  # imports triton

        few_tokens = hidden.shape[0] <= kernels.ROUTER_LOGITS_MAX_TOKENS
        if few_tokens and not self.config.grouped:  # logits and selection in one launch
            return kernels.route_triton(hidden, self.weight, self.config, self.e_score_correction_bias,
                                        self.route_counter)
        logits = kernels.router_logits_triton(hidden, self.weight) if few_tokens else F.linear(hidden.float(), self.weight)
        if self.config.grouped:
            return select_experts(logits, self.config, self.e_score_correction_bias)
        return kernels.select_experts_triton(logits, self.config, self.e_score_correction_bias)


class MoE(nn.Module):
    """Routed experts plus the shared experts (`mlp.gate`, `mlp.experts`, `mlp.shared_experts`),
    all packed in `experts` (the router appends the shared ones to every token's choice)."""

    def __init__(self, config: RouterConfig, hidden_size: int, moe_intermediate_size: int, *, dtype=None, device=None):
        super().__init__()
        self.gate = Router(config, hidden_size, device=device)
        self.experts = PackedExperts(config.num_experts, hidden_size, moe_intermediate_size,
                                     config.num_shared_experts, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(hidden)  # [T, top_k + num_shared] each
        return self.experts(hidden, weights, ids)


def expert_weight_rules() -> list[WeightRule]:
    """Per-expert checkpoint tensors -> the packed parameters (match before the plain gate/up
    rules, which would otherwise claim `experts.{e}.gate_proj`)."""
    return [
        WeightRule(r"\.shared_experts\.gate_proj\.weight$", ".experts.gate_up_proj", ("shared", 0)),
        WeightRule(r"\.shared_experts\.up_proj\.weight$", ".experts.gate_up_proj", ("shared", 1)),
        WeightRule(r"\.shared_experts\.down_proj\.weight$", ".experts.down_proj", "shared"),
        WeightRule(r"\.experts\.(\d+)\.gate_proj\.weight$", ".experts.gate_up_proj",
                   lambda m: (int(m.group(1)), 0)),
        WeightRule(r"\.experts\.(\d+)\.up_proj\.weight$", ".experts.gate_up_proj",
                   lambda m: (int(m.group(1)), 1)),
        WeightRule(r"\.experts\.(\d+)\.down_proj\.weight$", ".experts.down_proj",
                   lambda m: int(m.group(1))),
    ]
