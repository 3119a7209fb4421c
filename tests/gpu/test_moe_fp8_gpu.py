"""DeepSeek-V3 / Kimi-K2's FP8 experts through the GEMV kernels (ops/moe/fp8_triton_gemv.py) on a CUDA
device: bf16 x at DeepSeek-V3's expert shapes (hidden 7168, intermediate 2048, 128 x 128 blocks, 8
routed + 1 shared slot) and a small ragged shape, against the torch twin (fp8_experts_forward_torch:
each weight dequantized and rounded to bf16), with the block scales on x (SCALE_X, the default) and
on each weight; capture and replay in a CUDA graph. What Triton's interpreter cannot show: bf16,
real sizes, the atomics of the slot split on a device.

Weights are random normal values cast to float8_e4m3fn, scales random positive float32 of a size
that keeps the projections near unit size. Fresh random inputs every run; a failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from foretell.ops.gemm.fp8_reference import FP8_DTYPE
from foretell.ops.moe.fp8_reference import fp8_experts_forward_torch
from foretell.ops.moe.fp8_triton_gemv import fused_fp8_experts_gemv_triton

DEVICE = torch.device("cuda")
BLOCK = (128, 128)
V3 = {"experts": 24, "top_k": 9, "hidden": 7168, "inter": 2048}  # V3's expert sizes (fewer experts stored)
SMALL = {"experts": 12, "top_k": 3, "hidden": 328, "inter": 200}  # ragged blocks and tiles
TOLERANCE = 3e-2  # the twin rounds each weight to bf16, the kernels scale unrounded products


def assert_near_twin(got, want):
    """Within TOLERANCE, with an absolute floor of 2^-6 of the largest output: a token's output sums
    9 weighted slot outputs, each rounded to bf16 (an ulp of 2^-8 of its size) where a weight's
    rounding can tip it, so an output near 0 can be a few of its slots' ulps off; and on average
    within 2^-7 of the output's mean size (a wrong scale or block row is off by its whole size)."""
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=want.abs().max().item() / 64)
    assert (got.float() - want.float()).abs().mean() <= want.float().abs().mean() / 128
PER_WEIGHT_SCALES = {"gate_up": {"SCALE_X": False}, "down": {"SCALE_X": False}}


def fp8_experts(experts, hidden, inter, gen):
    def linear(n, k):
        q = torch.randn(experts, n, k, generator=gen, device=DEVICE).to(FP8_DTYPE)
        rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
        scale = (torch.rand(experts, rows, cols, generator=gen, device=DEVICE) + 0.5) / k**0.5
        return q, scale

    return (*linear(2 * inter, hidden), *linear(hidden, inter))


def routed_tokens(num_tokens, experts, top_k, hidden, gen):
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    ids = torch.rand(num_tokens, experts, generator=gen, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen, device=DEVICE) * 2.5  # V3's routed scaling
    shared = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    return x, weights, ids, shared


@pytest.mark.parametrize("shape", [V3, SMALL], ids=["deepseek-v3", "small"])
@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_gemv_matches_the_twin(shape, num_tokens):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    experts = fp8_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(num_tokens, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode(), reports_seed(seed):
        want = (fp8_experts_forward_torch(x, *experts, BLOCK, weights, ids) + shared).to(x.dtype)
        scaled_x = fused_fp8_experts_gemv_triton(x, *experts, BLOCK, weights, ids, shared)
        per_weight = fused_fp8_experts_gemv_triton(x, *experts, BLOCK, weights, ids, shared, config=PER_WEIGHT_SCALES)
        for got in (scaled_x, per_weight):
            assert got.dtype == x.dtype and torch.isfinite(got).all()
            assert_near_twin(got, want)
        unsplit = fused_fp8_experts_gemv_triton(x, *experts, BLOCK, weights, ids, shared, config={"down": {"SPLIT": 1}})
        assert torch.equal(unsplit, scaled_x)  # the slot split sums in slot order, as one program would


def test_captured_in_a_cuda_graph():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shape = V3
    experts = fp8_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(1, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode():
        fused_fp8_experts_gemv_triton(x, *experts, BLOCK, weights, ids, shared)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_fp8_experts_gemv_triton(x, *experts, BLOCK, weights, ids, shared)
        for _ in range(3):
            new_x, new_weights, new_ids, new_shared = routed_tokens(1, shape["experts"], shape["top_k"],
                                                                    shape["hidden"], gen)
            for buffer, value in ((x, new_x), (weights, new_weights), (ids, new_ids), (shared, new_shared)):
                buffer.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_fp8_experts_gemv_triton(x, *experts, BLOCK, weights, ids, shared))
