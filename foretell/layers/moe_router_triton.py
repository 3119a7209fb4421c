"""MoE expert selection (routing) on the GPU: one Triton kernel from router logits to the top-k
expert ids and weights, in place of the ~6 small torch kernels (sigmoid or softmax, bias add,
topk, gather, sum and divide, scale) that each MoE layer launches per decode step.

Twin: `select_experts` in moe.py, for ungrouped configs (`RouterConfig.grouped` False: greedy, or
noaux_tc / group_limited_greedy with n_group 1); grouped configs stay on the twin.
tests/test_moe_router_triton.py holds them together on random logits in Triton's interpreter,
tests/gpu/test_moe_router_gpu.py on CUDA.

Per token, in float32 registers (the experts padded to a power of two with -inf):
  scores  = sigmoid(logits), or softmax as exp(x - max) / sum
  choice  = scores + correction_bias                       (when a bias is given)
  ids     = top_k of choice by repeated argmax, in descending order of choice as torch.topk
            returns them; an exact tie goes to the lower expert id
  weights = scores at ids, / (their sum + 1e-20) when norm_topk_prob and top_k > 1,
            * routed_scaling_factor
The ids equal the twin's wherever no two choices lie within an exp's error of each other; the
weights differ by a few units in the last place of float32 (another exp, another order of the
sums; on CUDA tl.exp is ex2.approx of x * log2(e), up to about 1e-6 relative for |x| near 10).
The grid depends only on shapes and nothing syncs with the host, so a launch can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.layers.moe import RouterConfig


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _select_experts_kernel(
    logits_ptr,  # [num_tokens, num_experts] float32, rows stride_logits apart, columns contiguous
    bias_ptr,  # [num_experts] float32 (unread without HAS_BIAS)
    weights_ptr,  # [num_tokens, TOP_K] float32 out
    ids_ptr,  # [num_tokens, TOP_K] int64 out
    num_tokens,
    num_experts,
    stride_logits,
    scaling,  # routed_scaling_factor
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,  # else softmax
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,  # norm_topk_prob and TOP_K > 1
    BLOCK_T: tl.constexpr,  # tokens per program
    EXPERTS_P: tl.constexpr,  # num_experts rounded up to a power of two
    TOP_K_P: tl.constexpr,  # TOP_K rounded up to a power of two
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    row_ok = rows < num_tokens
    experts = tl.arange(0, EXPERTS_P)  # [EXPERTS_P]
    expert_ok = experts < num_experts
    mask = row_ok[:, None] & expert_ok[None, :]  # [BLOCK_T, EXPERTS_P]
    offsets = rows[:, None] * stride_logits + experts[None, :]
    x = tl.load(logits_ptr + offsets, mask=mask, other=float("-inf"))  # [BLOCK_T, EXPERTS_P]
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))  # padding: 0
    else:
        row_max = tl.max(x, axis=1)  # [BLOCK_T]
        row_max = tl.where(row_ok, row_max, 0.0)  # rows past the end hold only -inf
        e = tl.exp(x - row_max[:, None])  # padding: 0
        total = tl.where(row_ok, tl.sum(e, axis=1), 1.0)  # [BLOCK_T]; no 0 / 0 past the end
        scores = e / total[:, None]
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + experts, mask=expert_ok, other=0.0)  # [EXPERTS_P]
        choice = scores + bias[None, :]
    choice = tl.where(mask, choice, float("-inf"))

    ks = tl.arange(0, TOP_K_P)  # [TOP_K_P]
    top_ids = tl.zeros([BLOCK_T, TOP_K_P], dtype=tl.int32)
    top_weights = tl.zeros([BLOCK_T, TOP_K_P], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)  # [BLOCK_T]
        # The lowest expert holding the best choice (an exact tie goes to the lower id).
        best_id = tl.min(tl.where(choice == best[:, None], experts[None, :], EXPERTS_P), axis=1)
        picked = experts[None, :] == best_id[:, None]  # [BLOCK_T, EXPERTS_P], one per row
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)  # [BLOCK_T]: its unbiased score
        top_ids = tl.where(ks[None, :] == k, best_id[:, None], top_ids)
        top_weights = tl.where(ks[None, :] == k, weight[:, None], top_weights)
        choice = tl.where(picked, float("-inf"), choice)
    if NORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, axis=1)[:, None] + 1e-20)  # padding k: 0
    top_weights = top_weights * scaling

    out_mask = row_ok[:, None] & (ks[None, :] < TOP_K)  # [BLOCK_T, TOP_K_P]
    out_offsets = rows[:, None] * TOP_K + ks[None, :]
    tl.store(weights_ptr + out_offsets, top_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, top_ids.to(tl.int64), mask=out_mask)


def select_experts_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [num_experts] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] f32, ids [.., top_k] int64
    """`select_experts` as one kernel launch, for ungrouped configs; fresh contiguous outputs."""
    if config.grouped:
        raise ValueError(
            f"select_experts_triton handles ungrouped routing only; this config has n_group="
            f"{config.n_group} with topk_method {config.topk_method!r} (use select_experts)"
        )
    num_experts, top_k = config.num_experts, config.top_k
    if router_logits.dim() != 2 or router_logits.shape[1] != num_experts:
        raise ValueError(
            f"router_logits must be [num_tokens, {num_experts}], got {list(router_logits.shape)}"
        )
    if router_logits.dtype != torch.float32:
        raise ValueError(f"router_logits must be float32, got {router_logits.dtype}")
    if correction_bias is not None and (
        correction_bias.shape != (num_experts,)
        or correction_bias.dtype != torch.float32
        or correction_bias.device != router_logits.device
    ):
        raise ValueError(
            f"correction_bias must be [{num_experts}] float32 on {router_logits.device}, got "
            f"{list(correction_bias.shape)} {correction_bias.dtype} on {correction_bias.device}"
        )
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    if correction_bias is not None and not correction_bias.is_contiguous():
        correction_bias = correction_bias.contiguous()

    num_tokens = router_logits.shape[0]
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)  # [T, top_k]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)  # [T, top_k]
    if num_tokens == 0:
        return weights, ids
    experts_p = _next_pow2(num_experts)
    block_t = max(1, min(16, 2048 // experts_p))  # about 2048 elements in a program's tile
    num_warps = max(1, min(8, block_t * experts_p // 256))
    grid = (triton.cdiv(num_tokens, block_t),)
    _select_experts_kernel[grid](
        router_logits,
        correction_bias if correction_bias is not None else router_logits,  # unread without a bias
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        float(config.routed_scaling_factor),
        TOP_K=top_k,
        SIGMOID=config.scoring_func == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        NORMALIZE=config.norm_topk_prob and top_k > 1,
        BLOCK_T=block_t,
        EXPERTS_P=experts_p,
        TOP_K_P=_next_pow2(top_k),
        num_warps=num_warps,
    )
    return weights, ids
