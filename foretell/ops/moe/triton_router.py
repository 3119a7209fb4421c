"""MoE expert selection (routing) on the GPU: one Triton kernel from router logits to the top-k
expert ids and weights, in place of the ~6 small torch kernels (sigmoid or softmax, bias add,
topk, gather, sum and divide, scale) that each MoE layer launches per decode step; and, for a
few tokens (decode, verify), one kernel for the router logits themselves (`router_logits_triton`:
the hidden states read in the model dtype and widened to float32 in registers, against the float32
gate weight), in place of a cast and cuBLAS's two-kernel float32 GEMV. `route_triton` does both in
one launch (what Router.forward runs for few tokens): the last logits program to finish, counted
with an atomic in the Router's `route_counter`, selects for every token and resets the counter.

Twin: `select_experts` in reference.py, for ungrouped configs (`RouterConfig.grouped` False: greedy, or
noaux_tc / group_limited_greedy with n_group 1); grouped configs stay on the twin.
tests/ops/test_moe_router.py holds them together on random logits in Triton's interpreter,
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

from foretell.ops.moe.reference import RouterConfig


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _select_rows(
    rows,  # [BLOCK_T] int64 token indices (past num_tokens: ignored)
    logits_ptr,  # [num_tokens, num_experts] float32, rows stride_logits apart, columns contiguous
    bias_ptr,  # [num_experts] float32 (unread without HAS_BIAS)
    weights_ptr,  # [num_tokens, TOP_K + NUM_SHARED] float32 out
    ids_ptr,  # [num_tokens, TOP_K + NUM_SHARED] int64 out
    num_tokens,
    num_experts,
    stride_logits,
    scaling,  # routed_scaling_factor
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,  # shared experts appended after the top k (ids num_experts.., weight 1)
    SIGMOID: tl.constexpr,  # else softmax
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,  # norm_topk_prob and TOP_K > 1
    BLOCK_T: tl.constexpr,  # tokens per call
    EXPERTS_P: tl.constexpr,  # num_experts rounded up to a power of two
    TOP_K_P: tl.constexpr,  # TOP_K rounded up to a power of two
    SHARED_P: tl.constexpr,  # NUM_SHARED rounded up to a power of two (1 when there are none)
    LOGITS_CACHE: tl.constexpr,  # ".cg" when other programs of this launch wrote the logits
):
    """Routing of BLOCK_T tokens: their top-k ids and weights (and the shared experts) stored."""
    row_ok = rows < num_tokens
    experts = tl.arange(0, EXPERTS_P)  # [EXPERTS_P]
    expert_ok = experts < num_experts
    mask = row_ok[:, None] & expert_ok[None, :]  # [BLOCK_T, EXPERTS_P]
    offsets = rows[:, None] * stride_logits + experts[None, :]
    x = tl.load(logits_ptr + offsets, mask=mask, other=float("-inf"), cache_modifier=LOGITS_CACHE)
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

    width = TOP_K + NUM_SHARED  # columns of an output row
    out_mask = row_ok[:, None] & (ks[None, :] < TOP_K)  # [BLOCK_T, TOP_K_P]
    out_offsets = rows[:, None] * width + ks[None, :]
    tl.store(weights_ptr + out_offsets, top_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, top_ids.to(tl.int64), mask=out_mask)
    if NUM_SHARED > 0:
        shared = tl.arange(0, SHARED_P)  # [SHARED_P]
        shared_mask = row_ok[:, None] & (shared[None, :] < NUM_SHARED)  # [BLOCK_T, SHARED_P]
        shared_offsets = rows[:, None] * width + TOP_K + shared[None, :]
        ones = tl.full([BLOCK_T, SHARED_P], 1.0, dtype=tl.float32)
        shared_ids = tl.zeros([BLOCK_T, SHARED_P], dtype=tl.int64) + (num_experts + shared)[None, :]
        tl.store(weights_ptr + shared_offsets, ones, mask=shared_mask)
        tl.store(ids_ptr + shared_offsets, shared_ids, mask=shared_mask)


@triton.jit
def _select_experts_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,  # as _select_rows
    num_tokens,
    num_experts,
    stride_logits,
    scaling,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXPERTS_P: tl.constexpr,
    TOP_K_P: tl.constexpr,
    SHARED_P: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    _select_rows(rows, logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits,
                 scaling, TOP_K, NUM_SHARED, SIGMOID, HAS_BIAS, NORMALIZE, BLOCK_T, EXPERTS_P, TOP_K_P,
                 SHARED_P, "")


# Router logits in one kernel up to this many tokens; more go to cuBLAS (a program re-reads the
# gate weight per block of tokens, which only pays while the blocks are few).
ROUTER_LOGITS_MAX_TOKENS = 16


@triton.jit
def _logits_block(
    x_ptr,  # [num_tokens, hidden] model dtype, rows stride_x apart, columns contiguous
    w_ptr,  # [num_experts, hidden] float32 contiguous
    out_ptr,  # [num_tokens, num_experts] float32
    num_tokens,
    num_experts,
    hidden,
    stride_x,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The logits of this program's block of tokens and block of experts, stored."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    lanes = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    row_ok = rows < num_tokens
    expert_ok = experts < num_experts
    # Partial products per (token, expert, lane), reduced across the lanes once at the end.
    acc = tl.zeros((BLOCK_T, BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h_ok = (h0 + lanes) < hidden
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + h0 + lanes[None, :],
                    mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H]
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * hidden + h0 + lanes[None, :],
                    mask=expert_ok[:, None] & h_ok[None, :], other=0.0)  # [BLOCK_E, BLOCK_H]
        acc += x[:, None, :] * w[None, :, :]
    logits = tl.sum(acc, axis=2)  # [BLOCK_T, BLOCK_E]
    offsets = rows[:, None].to(tl.int64) * num_experts + experts[None, :]
    tl.store(out_ptr + offsets, logits, mask=row_ok[:, None] & expert_ok[None, :])


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, num_tokens, num_experts, hidden, stride_x,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    _logits_block(x_ptr, w_ptr, out_ptr, num_tokens, num_experts, hidden, stride_x, BLOCK_T, BLOCK_E, BLOCK_H)


@triton.jit
def _route_kernel(
    x_ptr, w_ptr, logits_ptr,  # as _logits_block (logits: scratch)
    bias_ptr, weights_ptr, ids_ptr,  # as _select_rows
    counter_ptr,  # [1] int32, zero between launches: programs that have stored their logits
    num_tokens,
    num_experts,
    hidden,
    stride_x,
    scaling,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TOP_K: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SELECT_T: tl.constexpr,  # tokens per step of the selection
    EXPERTS_P: tl.constexpr,
    TOP_K_P: tl.constexpr,
    SHARED_P: tl.constexpr,
):
    """Router logits, then the selection: the last program to store its block of logits routes
    every token (one launch instead of two), and resets the counter for the next launch."""
    _logits_block(x_ptr, w_ptr, logits_ptr, num_tokens, num_experts, hidden, stride_x, BLOCK_T, BLOCK_E, BLOCK_H)
    tl.debug_barrier()  # every thread's logits are stored before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        for t0 in range(0, num_tokens, SELECT_T):
            rows = t0 + tl.arange(0, SELECT_T).to(tl.int64)  # [SELECT_T]
            _select_rows(rows, logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, num_experts,
                         scaling, TOP_K, NUM_SHARED, SIGMOID, HAS_BIAS, NORMALIZE, SELECT_T, EXPERTS_P, TOP_K_P,
                         SHARED_P, ".cg")
        tl.atomic_xchg(counter_ptr, 0)


def _logits_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden checked against the gate weight (returned with a unit column stride)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [num_tokens, H] and weight [num_experts, H], got {list(hidden.shape)} "
            f"and {list(weight.shape)}"
        )
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.device != hidden.device:
        raise ValueError(f"weight must be a contiguous float32 tensor on {hidden.device}, got "
                         f"{weight.dtype} on {weight.device}")
    if hidden.shape[0] > ROUTER_LOGITS_MAX_TOKENS:
        raise ValueError(f"router logits in Triton take up to {ROUTER_LOGITS_MAX_TOKENS} tokens, got "
                         f"{hidden.shape[0]} (use F.linear)")
    return hidden if hidden.stride(1) == 1 else hidden.contiguous()


def _logits_launch(num_tokens: int, num_experts: int, hidden_size: int) -> tuple[tuple[int, int], dict]:
    # One expert per program (64 experts: 64 programs), and the whole hidden size in one or a few
    # loads: at batch 1 the kernel is latency-bound (4 experts per program with 512-wide steps
    # measured about what the cast + cuBLAS pair took on the H200: docs/perf-log.md).
    block_t = _next_pow2(num_tokens)
    block_h = max(16, min(4096 // block_t, _next_pow2(hidden_size)))
    grid = (triton.cdiv(num_tokens, block_t), num_experts)
    return grid, {"BLOCK_T": block_t, "BLOCK_E": 1, "BLOCK_H": block_h}


def router_logits_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden_size], any float dtype, unit column stride
    weight: torch.Tensor,  # [num_experts, hidden_size] float32 contiguous
) -> torch.Tensor:  # [num_tokens, num_experts] float32
    """F.linear(hidden.float(), weight) in one launch, for up to ROUTER_LOGITS_MAX_TOKENS tokens."""
    hidden = _logits_inputs(hidden, weight)
    num_tokens, hidden_size = hidden.shape
    num_experts = weight.shape[0]
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return logits
    grid, blocks = _logits_launch(num_tokens, num_experts, hidden_size)
    _router_logits_kernel[grid](
        hidden, weight, logits, num_tokens, num_experts, hidden_size, hidden.stride(0), **blocks, num_warps=4,
    )
    return logits


def route_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden_size], up to ROUTER_LOGITS_MAX_TOKENS tokens
    weight: torch.Tensor,  # [num_experts, hidden_size] float32 contiguous
    config: RouterConfig,  # ungrouped
    correction_bias: torch.Tensor | None,  # [num_experts] float32
    counter: torch.Tensor,  # [>= 1] int32, zero; the caller keeps it (a graph captures its address)
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k + shared] f32, ids [T, top_k + shared] int64
    """router_logits_triton then select_experts_triton, as one launch."""
    hidden = _logits_inputs(hidden, weight)
    correction_bias = _select_inputs(config, weight.shape[0], correction_bias, hidden.device)
    if counter.dtype != torch.int32 or counter.numel() < 1 or counter.device != hidden.device:
        raise ValueError(f"counter must be an int32 tensor of at least one element on {hidden.device}, got "
                         f"{counter.dtype} [{counter.numel()}] on {counter.device}")
    num_tokens, hidden_size = hidden.shape
    num_experts = weight.shape[0]
    weights, ids = _routing_outputs(num_tokens, config, hidden.device)
    if num_tokens == 0:
        return weights, ids
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=hidden.device)  # scratch
    grid, blocks = _logits_launch(num_tokens, num_experts, hidden_size)
    _route_kernel[grid](
        hidden, weight, logits,
        correction_bias if correction_bias is not None else logits,  # unread without a bias
        weights, ids, counter, num_tokens, num_experts, hidden_size, hidden.stride(0),
        float(config.routed_scaling_factor), **blocks, **_selection_constants(config, correction_bias),
        SELECT_T=_select_block(num_experts), num_warps=4,
    )
    return weights, ids


def _select_inputs(config: RouterConfig, num_experts: int, correction_bias: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor | None:
    """The config and bias checked for the kernel (the bias returned contiguous)."""
    if config.grouped:
        raise ValueError(
            f"select_experts_triton handles ungrouped routing only; this config has n_group="
            f"{config.n_group} with topk_method {config.topk_method!r} (use select_experts)"
        )
    if num_experts != config.num_experts:
        raise ValueError(f"the router has {num_experts} experts but the config {config.num_experts}")
    if correction_bias is None:
        return None
    if correction_bias.shape != (num_experts,) or correction_bias.dtype != torch.float32 or correction_bias.device != device:
        raise ValueError(
            f"correction_bias must be [{num_experts}] float32 on {device}, got "
            f"{list(correction_bias.shape)} {correction_bias.dtype} on {correction_bias.device}"
        )
    return correction_bias.contiguous()


def _routing_outputs(num_tokens: int, config: RouterConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = config.top_k + config.num_shared_experts
    weights = torch.empty(num_tokens, width, dtype=torch.float32, device=device)  # [T, width]
    ids = torch.empty(num_tokens, width, dtype=torch.int64, device=device)  # [T, width]
    return weights, ids


def _selection_constants(config: RouterConfig, correction_bias: torch.Tensor | None) -> dict:
    return dict(
        TOP_K=config.top_k,
        NUM_SHARED=config.num_shared_experts,
        SIGMOID=config.scoring_func == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        NORMALIZE=config.norm_topk_prob and config.top_k > 1,
        EXPERTS_P=_next_pow2(config.num_experts),
        TOP_K_P=_next_pow2(config.top_k),
        SHARED_P=_next_pow2(max(config.num_shared_experts, 1)),
    )


def _select_block(num_experts: int) -> int:
    return max(1, min(16, 2048 // _next_pow2(num_experts)))  # about 2048 elements in a tile


def select_experts_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [num_experts] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k + shared] f32, ids [T, top_k + shared] int64
    """`select_experts` as one kernel launch, for ungrouped configs; fresh contiguous outputs
    (the config's shared experts after the top_k, as select_experts appends them)."""
    num_experts = config.num_experts
    correction_bias = _select_inputs(config, num_experts, correction_bias, router_logits.device)
    if router_logits.dim() != 2 or router_logits.shape[1] != num_experts:
        raise ValueError(
            f"router_logits must be [num_tokens, {num_experts}], got {list(router_logits.shape)}"
        )
    if router_logits.dtype != torch.float32:
        raise ValueError(f"router_logits must be float32, got {router_logits.dtype}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    num_tokens = router_logits.shape[0]
    weights, ids = _routing_outputs(num_tokens, config, router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_t = _select_block(num_experts)
    _select_experts_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        correction_bias if correction_bias is not None else router_logits,  # unread without a bias
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        float(config.routed_scaling_factor),
        BLOCK_T=block_t,
        **_selection_constants(config, correction_bias),
        num_warps=max(1, min(8, block_t * _next_pow2(num_experts) // 256)),
    )
    return weights, ids
