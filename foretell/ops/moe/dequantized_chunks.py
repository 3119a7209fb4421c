"""Prefill through quantized experts with bounded memory: `experts_in_chunks` dequantizes the used
experts a chunk at a time and runs each chunk's (token, expert) pairs through a float grouped
experts function, so the dequantized weights never exceed `max_bytes` at once.

The int4 and FP8 dispatches (int4_dispatch.py, fp8_dispatch.py) take this path for many tokens:
dequantizing every used expert at once needs, at Kimi-K2.5's 384 experts of 7168 x 2048, some 30 GiB
(and DeepSeek-V3's FP8 dequantization passes through float32), which a prefill of a few hundred
tokens reaches (the H200 run of check_low_precision_gpu.py at afbc179 ran out of memory there).

Each pair is computed once, by the chunk holding its expert, as a top-1 call of `grouped` with
its routing weight (float32 out); the pairs' outputs are then summed per token in slot order
(k = 0, 1, ...) in float32, so the result does not depend on the chunking. The twins' sums
(reference.experts_forward_torch) add the same float32 values in expert order instead: the two
agree up to float32 rounding of the sum.

Host syncs: the used experts (torch.unique) and the pairs per expert (one .tolist()); never
while a CUDA graph is captured (the dispatches route captures to the GEMV kernels).
"""

from __future__ import annotations

from typing import Callable

import torch

# Dequantized expert weights held at once (bf16 at Kimi-K2.5's shapes: 88 MB an expert, 24 a chunk).
DEQUANTIZED_CHUNK_BYTES = 2 << 30

# (used expert ids [U]) -> (gate_up [U, 2I, H], down [U, H, I]) in the dtype the float kernels take
Dequantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (hidden [P, H], gate_up [U, 2I, H], down [U, H, I], weights [P, 1] float32, ids [P, 1] int64)
#   -> [P, H] float32: each row's expert output times its weight
GroupedExperts = Callable[..., torch.Tensor]


def experts_per_chunk(bytes_per_expert: int, max_bytes: int = DEQUANTIZED_CHUNK_BYTES) -> int:
    """How many dequantized experts of bytes_per_expert fit in max_bytes (at least one)."""
    if bytes_per_expert < 1 or max_bytes < 1:
        raise ValueError(f"bytes_per_expert and max_bytes must be positive, got {bytes_per_expert} and {max_bytes}")
    return max(1, max_bytes // bytes_per_expert)


def experts_in_chunks(
    hidden: torch.Tensor,  # [T, H], the dtype `grouped` takes
    weights: torch.Tensor,  # [T, top_k] float32
    ids: torch.Tensor,  # [T, top_k] int64
    dequantize: Dequantize,
    grouped: GroupedExperts,
    chunk_experts: int,  # used experts dequantized at once
) -> torch.Tensor:  # [T, H] float32: the top_k experts' weighted sum
    """The chosen experts' weighted sum, dequantizing at most chunk_experts used experts at a time."""
    if chunk_experts < 1:
        raise ValueError(f"chunk_experts must be >= 1, got {chunk_experts}")
    num_tokens, top_k = ids.shape
    hidden_size = hidden.shape[-1]
    used, compact = torch.unique(ids, return_inverse=True)  # [U], [T, top_k] (one host sync)
    flat_compact = compact.reshape(-1)  # [P] with P = T * top_k, pair p = token p // top_k, slot p % top_k
    order = flat_compact.argsort(stable=True)  # [P] pairs grouped by expert
    counts = torch.bincount(flat_compact, minlength=used.numel()).tolist()  # one host sync
    flat_weights = weights.reshape(-1).float()  # [P]
    pair_out = torch.empty(num_tokens * top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    start = 0
    for lo in range(0, used.numel(), chunk_experts):
        hi = min(lo + chunk_experts, used.numel())
        count = sum(counts[lo:hi])
        pairs = order[start : start + count]  # [P_c]
        start += count
        gate_up, down = dequantize(used[lo:hi])  # [hi - lo, 2I, H], [hi - lo, H, I]
        pair_out[pairs] = grouped(hidden.index_select(0, pairs // top_k), gate_up, down,
                                  flat_weights[pairs, None], (flat_compact[pairs] - lo)[:, None])
        del gate_up, down
    by_slot = pair_out.view(num_tokens, top_k, hidden_size)
    out = by_slot[:, 0].clone()  # [T, H]
    for slot in range(1, top_k):  # slot order, as the grouped kernels' combine
        out += by_slot[:, slot]
    return out
