"""Mixture of experts of the batch-invariant mode (ModelConfig.batch_invariant, issue 23), in torch.

Two things make the reference's result for a token depend on its batch: the router logits are one
float32 matmul over all tokens, and each expert's matmuls run over however many tokens chose it.
Here both are ops/gemm/batch_invariant's one-row products, and a token's experts are summed in a
fixed order, the order of its own slots (its top-k in the router's order, then the shared
experts), each weighted output added in float32 to a zero row, then `shared`. Expert selection
(select_experts) runs per row, on float64 scores (ops/pointwise/batch_invariant.py says why); the
activation is silu_and_mul_batch_invariant.

On CUDA (where ops.common.kernel_choice.use_triton allows) the experts run batch_invariant_triton.py
instead: the grouped kernels at one tile shape for every batch, sync-free, so graphs capture them.
This torch form syncs with the host once per layer (which experts have tokens): the CPU's path, and
CUDA's without triton. The router's product is ops/gemm's batch-invariant linear on either device.
"""

from __future__ import annotations

import torch

from foretell.ops.common.kernel_choice import use_triton
from foretell.ops.gemm.batch_invariant import linear_rows_torch
from foretell.ops.moe.reference import RouterConfig, select_experts
from foretell.ops.pointwise.batch_invariant import silu_and_mul_batch_invariant


def route_batch_invariant(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [num_experts, hidden] float32
    config: RouterConfig,
    correction_bias: torch.Tensor | None,  # [num_experts] float32 (noaux_tc)
) -> tuple[torch.Tensor, torch.Tensor]:  # weights float32, ids int64: [num_tokens, top_k + num_shared]
    logits = linear_rows_torch(hidden.float(), weight.float())  # [T, E] float32
    # Scores in float64 (sigmoid's vector and scalar forms differ at float32: ops/pointwise/
    # batch_invariant.py), the weights handed on in float32.
    weights, ids = select_experts(logits.double(), config, correction_bias)
    return weights.float(), ids


def experts_forward_batch_invariant(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [E, 2 * I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [num_tokens, k] float32
    ids: torch.Tensor,  # [num_tokens, k] int64
    shared: torch.Tensor | None = None,  # [num_tokens, hidden]: added after the experts
) -> torch.Tensor:  # [num_tokens, hidden], hidden's dtype
    num_tokens, top_k = ids.shape
    if weights.shape != ids.shape:
        raise ValueError(f"weights and ids must have one shape [num_tokens, k], got {list(weights.shape)} "
                         f"and {list(ids.shape)}")
    if use_triton(hidden, gate_up) and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32):
        from foretell.ops.moe.batch_invariant_triton import experts_forward_batch_invariant_triton  # imports triton

        return experts_forward_batch_invariant_triton(hidden, gate_up, down, weights, ids, shared)
    # Each (token, slot) pair's weighted expert output, computed per expert (rows independent).
    per_slot = torch.zeros(num_tokens, top_k, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_ids = ids.flatten()  # [T * k]
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()  # one host sync
    flat_out = per_slot.view(num_tokens * top_k, -1)  # [T * k, hidden]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]  # flat (token, slot) indices
        start += count
        x = hidden.index_select(0, pairs // top_k)  # [count, hidden]
        act = silu_and_mul_batch_invariant(linear_rows_torch(x, gate_up[expert]))  # [count, I]
        y = linear_rows_torch(act, down[expert]).float()  # [count, hidden]
        flat_out.index_copy_(0, pairs, y * weights.flatten()[pairs, None])
    out = per_slot[:, 0].clone()
    for slot in range(1, top_k):  # the token's own slot order, one add at a time
        out += per_slot[:, slot]
    if shared is not None:
        out = out + shared
    return out.to(hidden.dtype)
