"""The int4 experts' tensor-core kernels (ops/moe/triton_int4_mma.py) on a CUDA device: bf16 at
Kimi-K2.5's shapes (384 routed experts, 8 per token, hidden 7168, intermediate 2048, the shared
expert's output added) and a small odd shape (partial groups, words and tiles), at 1 to 16 tokens,
against the torch twin (int4_experts_forward_torch) and the GEMV kernels; the inline-PTX decoding
against the plain Triton one (the same weights: bit for bit the same output); split-K and the
last-to-arrive sums (every split gives the twin, repeated runs the same bits); an expert in more
than 16 pairs and repeated experts in a token; the dispatch's choice; capture and replay in a CUDA
graph. What Triton's interpreter cannot show: bf16, inline PTX, real sizes, atomics on a device.

Packed words are random int32 (every nibble pattern), scales random positive bf16 of the size
compressed-tensors gives (amax / 7.5). Outputs are compared by their largest error over the
output's largest value (the twin rounds each slot's output to bf16 at the same points; sums in
another order flip some of those roundings by an ulp, which an elementwise rtol reads as failures
near zero), and by their mean error. Fresh random inputs every run; a failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from foretell.ops.moe import int4_reference as ref
from foretell.ops.moe.int4_dispatch import INT4_MMA_MAX_TOKENS, fused_int4_experts
from foretell.ops.moe.triton_int4_gemv import fused_int4_experts_gemv_triton
from foretell.ops.moe.triton_int4_mma import fused_int4_experts_mma_triton

DEVICE = torch.device("cuda")
KIMI_K25 = {"experts": 384, "top_k": 8, "hidden": 7168, "inter": 2048}
SMALL = {"experts": 12, "top_k": 3, "hidden": 330, "inter": 204}  # partial groups, words and tiles
MAX_ERROR = 1e-2  # of the output's largest value
MEAN_ERROR = 1e-3


def int4_experts(experts, hidden, inter, gen, dtype=torch.bfloat16):
    def linear(n, k):
        packed = torch.randint(-2**31, 2**31 - 1, (experts, n, ref.words(k)), generator=gen, device=DEVICE,
                               dtype=torch.int32)
        scale = (torch.rand(experts, n, ref.groups(k), generator=gen, device=DEVICE) + 0.5) / (4 * k**0.5)
        return packed, scale.to(dtype)

    return (*linear(2 * inter, hidden), *linear(hidden, inter))


def routed_tokens(num_tokens, experts, top_k, hidden, gen, dtype=torch.bfloat16):
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    ids = torch.rand(num_tokens, experts, generator=gen, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen, device=DEVICE) * 2.8  # Kimi's routed scaling
    shared = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    return x, weights, ids, shared


def assert_near(got, want):
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    assert err.max().item() <= MAX_ERROR * scale, f"max error {err.max().item():.4g} over {scale:.4g}"
    assert err.mean().item() <= MEAN_ERROR * scale, f"mean error {err.mean().item():.4g} over {scale:.4g}"


@pytest.mark.parametrize("shape_id, num_tokens", [(s, t) for s in ("kimi-k2.5", "small") for t in (1, 2, 4, 8, 16)])
def test_mma_matches_the_twin_and_the_gemv(shape_id, num_tokens):
    shape = KIMI_K25 if shape_id == "kimi-k2.5" else SMALL
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(num_tokens, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode(), reports_seed(seed):
        want = (ref.int4_experts_forward_torch(x, *weights_int4, weights, ids) + shared).to(x.dtype)
        got = fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype)
        assert_near(got, want)
        plain = fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype,
                                              decode_ptx=False)
        assert torch.equal(got, plain), "the inline-PTX decoding gave other weights than the plain one"
        gemv = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype)
        assert_near(got, gemv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_split_k_and_tiles_all_give_the_twin(dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = SMALL
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen, dtype)
    x, weights, ids, shared = routed_tokens(3, shape["experts"], shape["top_k"], shape["hidden"], gen, dtype)
    with torch.inference_mode(), reports_seed(seed):
        want = (ref.int4_experts_forward_torch(x, *weights_int4, weights, ids) + shared).to(dtype)
        for config in ({"gate_up": {"SPLIT_K": 1}, "down": {"SPLIT_K": 1}},
                       {"gate_up": {"SPLIT_K": 3, "BLOCK_N": 64}, "down": {"SPLIT_K": 2, "BLOCK_N": 16}},
                       {"gate_up": {"BLOCK_K": 256, "num_stages": 2}, "down": {"BLOCK_K": 256, "num_warps": 8}}):
            got = fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared, out_dtype=dtype, config=config)
            assert_near(got, want)


def test_split_sums_are_the_same_every_time():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = KIMI_K25
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(2, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode():
        first = fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared)
        for _ in range(30):
            assert torch.equal(fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared), first)


def test_hot_and_repeated_experts():
    """16 tokens all routed to expert 5 (one expert's rows in two MMA chunks of 16), one token with
    expert 9 twice in its top-k."""
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = KIMI_K25
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(16, shape["experts"], shape["top_k"], shape["hidden"], gen)
    ids[:, 0] = 5
    ids[:, 1] = 5  # 32 pairs on one expert
    ids[3, 2:4] = 9
    with torch.inference_mode(), reports_seed(seed):
        want = (ref.int4_experts_forward_torch(x, *weights_int4, weights, ids) + shared).to(x.dtype)
        assert_near(fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype), want)


@pytest.mark.parametrize("num_tokens", [1, INT4_MMA_MAX_TOKENS])
def test_dispatch_takes_the_mma_kernels_for_decode(num_tokens):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    shape = SMALL
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(num_tokens, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode():
        assert torch.equal(fused_int4_experts(x, *weights_int4, weights, ids, shared),
                           fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype))


def test_captured_in_a_cuda_graph():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shape = KIMI_K25
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(4, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode():
        fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared)
        for _ in range(3):
            new = routed_tokens(4, shape["experts"], shape["top_k"], shape["hidden"], gen)
            for buffer, value in zip((x, weights, ids, shared), new):
                buffer.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_int4_experts_mma_triton(x, *weights_int4, weights, ids, shared))
