"""The tensor-core few-row linear (ops/gemm/triton_mma.py) on a CUDA device: bf16 and fp16 at
Llama-3.1-8B's linear shapes for 1 to 16 rows and every candidate config (split-K included) against
a float64 product, a long K with a bias, the gated (SiLU-and-mul) epilogue; capture and replay in a CUDA graph
(split counters left zero, results bit-identical); and a chain of dependent launches mixing it with
the GEMV (programmatic dependent launch on Hopper: a missing wait would read a stale input).

Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch


from fixtures.float64_linear import LLAMA8B_SHAPES, check_dependent_chain, check_gated, check_linear
from fixtures.seeds import reports_seed
from foretell.ops.gemm import triton_gemv as sm
from foretell.ops.gemm import triton_mma as mma
from foretell.layers.linear import Linear
from foretell.layers.small_m import prepare_small_m_linears
from foretell.ops.gemm.dispatch import GemmKey

DEVICE = torch.device("cuda")


def _counters_zero():
    return all(int(b.count_nonzero()) == 0 for b in mma._COUNTERS._buffers.values())


def _random_linear(gen, m, n, k, dtype):
    """x [m, k], weight [n, k] (scaled by 1 / sqrt(k)) and bias [n], fresh random on the device."""
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    return x, weight, torch.randn(n, generator=gen, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", LLAMA8B_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("m", [1, 2, 4, 16])
def test_matches_float64_at_llama8b_shapes(dtype, shape, m):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, k = shape
    x, weight, _ = _random_linear(gen, m, n, k, dtype)
    with torch.inference_mode(), reports_seed(seed):
        for config in mma.candidate_configs(m, n, k, DEVICE):
            check_linear(mma.small_m_mma_linear(x, weight, None, config), x, weight, None)
            assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [4, 13])
def test_long_k_and_bias(dtype, m):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, k = 4096 + 40, 14336 + 24  # down_proj-like, neither a multiple of the tiles
    x, weight, bias = _random_linear(gen, m, n, k, dtype)
    with torch.inference_mode(), reports_seed(seed):
        for config in mma.candidate_configs(m, n, k, DEVICE):
            check_linear(mma.small_m_mma_linear(x, weight, bias, config), x, weight, bias)
            assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [4, 13])
def test_gated_output_and_bias(dtype, m):
    """A gate_up-like [gate; up] weight (neither half a multiple of the tiles) with the activation
    as the epilogue, for every candidate config (split-K: the merging split applies it)."""
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, k = 2 * (14336 + 20), 4096 + 24
    x, weight, bias = _random_linear(gen, m, n, k, dtype)
    with torch.inference_mode(), reports_seed(seed):
        for config in mma.candidate_configs(m, n, k, DEVICE):
            product = mma.small_m_mma_linear(x, weight, bias, config)
            check_linear(product, x, weight, bias)
            check_gated(mma.small_m_mma_linear(x, weight, bias, config, gated=True), product)
            assert torch.equal(mma.small_m_mma_linear(x, weight, bias, config, float32_out=True), product.float())
            assert _counters_zero()


def test_replays_in_a_cuda_graph_bit_identical():
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    m, n, k = 4, 4096, 14336
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(torch.bfloat16)
    configs = mma.candidate_configs(m, n, k, DEVICE)
    assert any(c.split > 1 for c in configs)

    def step():
        return [mma.small_m_mma_linear(x, weight, None, c) for c in configs]

    with torch.inference_mode(), reports_seed(seed):
        step()  # compiles, allocates the counters
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        for _ in range(3):
            x.copy_(torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16))
            graph.replay()
            for got, want in zip(static_out, step()):
                assert torch.equal(got, want)  # split partials summed in a fixed order
            assert _counters_zero()


@pytest.mark.parametrize("m", [1, 4])
def test_a_chain_of_dependent_launches_waits_for_each_input(m):
    """Eight linears (one gated) alternating the MMA (split and whole-K) and the GEMV, each reading the one
    before (a torch op between some), replayed in a CUDA graph: fp16 (the MMA's inputs, values kept
    small) against float64 (fixtures/float64_linear.check_dependent_chain)."""
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def kernel(i, h, w, gated):
        if i % 2 and m <= sm.MAX_M:
            return sm.small_m_linear(h, w, None, None, gated=gated)
        return mma.small_m_mma_linear(h, w, None, None, gated=gated)

    with reports_seed(seed):
        check_dependent_chain(kernel, m, torch.float16, gen,
                              [4096, 6144, 4096, 14336, 4096, 4096, 4096, 8192, 4096],
                              plain_scale=0.5, input_scale=1.0, rtol=2e-2)


def test_mode_on_runs_bf16_layers_of_2_to_16_rows_on_the_mma():
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layer = Linear(4096, 6144, dtype=torch.bfloat16, device=DEVICE)
    layer.weight.data.normal_(std=0.02)
    with torch.inference_mode(), reports_seed(seed):
        gemm = prepare_small_m_linears(layer, max_m=16, mode="on")
        for m in (1, 2, 4, 8, 16):
            config = gemm.choices[GemmKey(m, 6144, 4096, torch.bfloat16, False)]
            assert isinstance(config, sm.SmallMConfig if m == 1 else mma.MmaConfig)
        down = Linear(14336, 4096, dtype=torch.bfloat16, device=DEVICE)
        prepare_small_m_linears(down, max_m=4, mode="on", gemm=gemm)
        assert isinstance(gemm.choices[GemmKey(1, 4096, 14336, torch.bfloat16, False)], sm.SmallMConfig)
        assert gemm.choices[GemmKey(4, 4096, 14336, torch.bfloat16, False)].split == 4  # long K, 4 rows: split-K
        for m in (3, 16):
            x = torch.randn(m, 4096, device=DEVICE).to(torch.bfloat16)
            check_linear(layer(x), x, layer.weight, None)
