"""Plain-torch mixture-of-experts ops: the router's configuration and expert selection, and the
experts' forward over packed weights. What the CPU runs and what the Triton kernels are held to
(triton_router.py: select_experts; triton_experts.py and triton_gemv.py: experts_forward_torch).

Routing, computed in float32 whatever the model dtype:
  scores = sigmoid(logits) (V3, Kimi) or softmax(logits) (V2)
  choice = scores + e_score_correction_bias      (topk_method "noaux_tc"; bias only selects)
  with n_group > 1 only topk_group groups stay eligible; a group's score is the sum of its top 2
  choices ("noaux_tc") or its best score ("group_limited_greedy")
  experts = top-k of choice; weights = scores at those experts (unbiased),
            / their sum when norm_topk_prob, * routed_scaling_factor
The shared experts follow every token's routed ones with weight 1 (append_shared_experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def check_routing(
    ids: torch.Tensor,  # [num_tokens, top_k] int
    weights: torch.Tensor,  # [num_tokens, top_k]
    shared: torch.Tensor | None,  # [num_tokens, hidden_size]
    num_tokens: int,
    hidden_size: int,
) -> int:  # top_k
    """The routing a fused experts forward gets beside its hidden states [num_tokens, hidden_size],
    whatever its weights' format; ValueError naming the mismatch. Expert ids are not range-checked
    (that would read them on the host)."""
    if ids.dim() != 2 or ids.shape[0] != num_tokens or ids.is_floating_point():
        raise ValueError(f"ids must be an integer tensor [{num_tokens}, top_k] (one row per token of hidden), "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if shared is not None and (shared.shape != (num_tokens, hidden_size) or shared.stride(-1) != 1):
        raise ValueError(f"shared must be [{num_tokens}, {hidden_size}] with a unit last stride, "
                         f"got {tuple(shared.shape)} stride {shared.stride()}")
    return ids.shape[1]


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
