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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foretell.layers.linear import Linear, MergedLinear, check_shape, make_param
from foretell.ops.moe.dispatch import fused_experts, route
from foretell.ops.moe.reference import RouterConfig
from foretell.weight_rules import WeightRule

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
        return fused_experts(hidden, self.gate_up_proj, self.down_proj, weights, ids, shared)

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
        return route(hidden, self.weight, self.config, self.e_score_correction_bias, self.route_counter)


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
