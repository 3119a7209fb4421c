"""Kimi-K2.5's int4 experts (ops/moe/triton_int4_gemv.py, ops/moe/int4_dispatch.py) on a CUDA device:
bf16 scales at Kimi-K2.5's shapes (384 routed experts, 8 per token, hidden 7168, intermediate
2048, the shared expert's output added) and a small odd shape, against the torch twin
(int4_experts_forward_torch); the slot split repeated (its last-to-arrive sum must not race); the
dispatch's dequantize-then-grouped path for many tokens; capture and replay in a CUDA graph.
What Triton's interpreter cannot show: bf16, real sizes, the atomics on a device.

Packed words are random int32 (every nibble pattern), scales random positive bf16 of the size
compressed-tensors gives (amax / 7.5). Fresh random inputs every run; a failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch


from fixtures.seeds import reports_seed
from foretell.ops.moe import int4_reference as ref
from foretell.ops.moe.int4_dispatch import INT4_GEMV_MAX_TOKENS, fused_int4_experts
from foretell.ops.moe.triton_int4_gemv import fused_int4_experts_gemv_triton

DEVICE = torch.device("cuda")
KIMI_K25 = {"experts": 384, "top_k": 8, "hidden": 7168, "inter": 2048}
SMALL = {"experts": 12, "top_k": 3, "hidden": 328, "inter": 200}  # a partial group and partial tiles
TOLERANCE = 3e-2  # bf16 roundings at the same points, float32 sums in another order


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


KIMI_MISMATCH = pytest.mark.xfail(
    reason="H200, 2026-12-01: at 8bbcb5f the int4 GEMV differed from its twin beyond tolerance at Kimi-K2.5 "
           "shapes at 1 and 8 tokens (random seeds); at afbc179 it passed at 1, 2, 4 and 8 tokens (XPASS); at "
           "b3ec0f8 it failed at all four. The nibble decoding was rewritten since (efaf29a: floats made a "
           "byte at a time, x's lanes pre-scaled, a per-word correction): drop this mark once it passes on "
           "the H200 again.", strict=False)

SMALL_MISMATCH = pytest.mark.xfail(
    reason="H200: after 923077a (weights enter as q * s unrounded, the twin rounds them to bf16) the small "
           "shape differed from its twin beyond tolerance at 4 and 8 tokens (0ca8a8c, b3ec0f8); 1 and 2 pass "
           "(XPASS at b3ec0f8). Either the tolerance or the kernel: not yet found (Triton's interpreter rounds "
           "bf16 differently from the device, so the CPU cannot tell).", strict=False)


TILE_LANES = {"gate_up": {"LANES": False}, "down": {"LANES": False}}  # x's lanes made in every tile


def _twin_marks(shape_id: str, num_tokens: int) -> list:
    if shape_id == "kimi-k2.5":
        return [KIMI_MISMATCH]
    return [SMALL_MISMATCH] if num_tokens >= 4 else []


@pytest.mark.parametrize("shape, num_tokens", [
    pytest.param(shape, tokens, marks=_twin_marks(shape_id, tokens), id=f"{tokens}-{shape_id}")
    for shape_id, shape in (("kimi-k2.5", KIMI_K25), ("small", SMALL)) for tokens in (1, 2, 4, 8)])
def test_gemv_matches_the_twin(shape, num_tokens):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(num_tokens, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode(), reports_seed(seed):
        want = (ref.int4_experts_forward_torch(x, *weights_int4, weights, ids) + shared).to(x.dtype)
        for config in (None, {"down": {"SPLIT": 1}}, {"down": {"SPLIT": 2, "BLOCK_N": 32}}, TILE_LANES,
                       {"gate_up": {"LANES": False, "BLOCK_N": 8}}):
            got = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype,
                                                 config=config)
            torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
        assert torch.equal(fused_int4_experts(x, *weights_int4, weights, ids, shared),
                           fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, out_dtype=x.dtype))


def test_slot_split_sum_is_the_same_every_time():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = KIMI_K25
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(2, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode():
        first = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared)
        unsplit = fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared, config={"down": {"SPLIT": 1}})
        assert torch.equal(first, unsplit)  # no FMA contraction: the same float32 sum in slot order
        for _ in range(50):
            assert torch.equal(fused_int4_experts_gemv_triton(x, *weights_int4, weights, ids, shared), first)


def test_many_tokens_take_the_dequantized_grouped_path():
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = SMALL
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(INT4_GEMV_MAX_TOKENS + 40, shape["experts"], shape["top_k"],
                                            shape["hidden"], gen)
    with torch.inference_mode(), reports_seed(seed):
        want = (ref.int4_experts_forward_torch(x, *weights_int4, weights, ids) + shared).to(x.dtype)
        torch.testing.assert_close(fused_int4_experts(x, *weights_int4, weights, ids, shared), want,
                                   rtol=TOLERANCE, atol=TOLERANCE)


def test_captured_in_a_cuda_graph():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shape = KIMI_K25
    weights_int4 = int4_experts(shape["experts"], shape["hidden"], shape["inter"], gen)
    x, weights, ids, shared = routed_tokens(1, shape["experts"], shape["top_k"], shape["hidden"], gen)
    with torch.inference_mode():
        fused_int4_experts(x, *weights_int4, weights, ids, shared)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_int4_experts(x, *weights_int4, weights, ids, shared)
        for _ in range(3):
            new_x, new_weights, new_ids, new_shared = routed_tokens(1, shape["experts"], shape["top_k"],
                                                                    shape["hidden"], gen)
            for buffer, value in ((x, new_x), (weights, new_weights), (ids, new_ids), (shared, new_shared)):
                buffer.copy_(value)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fused_int4_experts(x, *weights_int4, weights, ids, shared))
