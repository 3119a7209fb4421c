"""The two MoE entry points layers/moe.py calls: `route` (router logits and expert selection) and
`fused_experts` (the experts' weighted sum). On CUDA, when ops.common.kernel_choice.use_triton allows,
they run the Triton kernels (triton_router.py, triton_experts.py, loaded on first use: they import
triton); elsewhere the torch twins of reference.py. With batch_invariant (the mode of issue 23) both
run batch_invariant.py's torch forms, whose result for a token does not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.moe.batch_invariant import experts_forward_batch_invariant, route_batch_invariant
from foretell.ops.moe.reference import RouterConfig, experts_forward_torch, select_experts


def route(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [num_experts, hidden] float32
    config: RouterConfig,
    correction_bias: torch.Tensor | None,  # [num_experts] float32 (noaux_tc)
    route_counter: torch.Tensor,  # [1] int32, zero: the one-launch kernel's program count
    batch_invariant: bool = False,  # ModelConfig.batch_invariant: batch_invariant.py's router
) -> tuple[torch.Tensor, torch.Tensor]:  # weights float32, ids int64: [num_tokens, top_k + num_shared]
    """The router: logits, then the experts each token goes to and their weights."""
    if batch_invariant:
        return route_batch_invariant(hidden, weight, config, correction_bias)
    if not use_triton(hidden):
        logits = F.linear(hidden.float(), weight)  # [T, E] float32
        return select_experts(logits, config, correction_bias)
    from foretell.ops.moe import triton_router  # imports triton

    few_tokens = hidden.shape[0] <= triton_router.ROUTER_LOGITS_MAX_TOKENS
    if few_tokens and not config.grouped:  # logits and selection in one launch
        return triton_router.route_triton(hidden, weight, config, correction_bias, route_counter)
    logits = triton_router.router_logits_triton(hidden, weight) if few_tokens else F.linear(hidden.float(), weight)
    if config.grouped:
        return select_experts(logits, config, correction_bias)
    return triton_router.select_experts_triton(logits, config, correction_bias)


def fused_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, k] float32
    ids: torch.Tensor,  # [num_tokens, k] int64
    shared: torch.Tensor | None = None,  # [num_tokens, hidden]: the shared experts' output, added
    batch_invariant: bool = False,  # ModelConfig.batch_invariant: batch_invariant.py's fixed-order sum
) -> torch.Tensor:  # [num_tokens, hidden], hidden's dtype
    """The chosen experts' weighted sum (plus `shared`), summed in float32, in hidden's dtype."""
    if batch_invariant:
        return experts_forward_batch_invariant(hidden, gate_up, down, weights, ids, shared)
    if use_triton(hidden, gate_up):
        from foretell.ops.moe.triton_experts import fused_experts_triton  # imports triton

        return fused_experts_triton(hidden, gate_up, down, weights, ids, shared=shared, out_dtype=hidden.dtype)
    out = experts_forward_torch(hidden, gate_up, down, weights, ids)  # float32
    if shared is not None:
        out = out + shared  # float32 + model dtype: one promoting add
    return out.to(hidden.dtype)
