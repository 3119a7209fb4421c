"""The GEMV (ops/gemm/triton_gemv.py) on a CUDA device, bf16 and fp16 at Llama-3.1-8B's linear
shapes, against a float64 product (also the gated SiLU-and-mul epilogue, float32 output); no host sync in a
launch; capture and replay in a CUDA graph; a chain of dependent launches (programmatic dependent
launch on Hopper: each must wait for its input) against a float64 chain; the dispatch
(ops/gemm/dispatch.py) timing real layers; and whole models whose greedy tokens do not change
when the kernel replaces cuBLAS (float32, so no near-ties).

Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F


from fixtures.float64_linear import LLAMA8B_SHAPES, check_dependent_chain, check_gated, check_linear
from fixtures.seeds import reports_seed
from foretell import LLM, SamplingParams
from foretell.ops.gemm import triton_gemv as sm
from foretell.layers.linear import Linear
from foretell.layers.small_m import prepare_small_m_linears
from foretell.ops.gemm.dispatch import GemmKey, SmallMGemm

DEVICE = torch.device("cuda")


def _inputs(gen, m, n, k, dtype, bias=False):
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", LLAMA8B_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("m", [1, 2, 4])
def test_matches_float64_at_llama8b_shapes(dtype, shape, m):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, k = shape
    x, weight, _ = _inputs(gen, m, n, k, dtype)
    with torch.inference_mode(), reports_seed(seed):
        for config in sm.candidate_configs(m, n, k, DEVICE):
            check_linear(sm.small_m_linear(x, weight, None, config), x, weight, None)
        # The float32 path of the brief: cuBLAS in float32 of the same inputs, as a cross-check.
        expected = F.linear(x.float(), weight.float())
        torch.testing.assert_close(sm.small_m_linear(x, weight).float(), expected,
                                   rtol=2 * torch.finfo(dtype).eps, atol=1e-3)
        del expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4])
def test_gated_output_at_the_gate_up_projection(dtype, m):
    """gate_up [28672, 4096] with the activation as the epilogue: [m, 14336]; and the product
    stored as float32 (LMHead's logits) holding the same values."""
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, k = LLAMA8B_SHAPES[2]
    x, weight, bias = _inputs(gen, m, n, k, dtype, bias=True)
    with torch.inference_mode(), reports_seed(seed):
        for config in sm.candidate_configs(m, n, k, DEVICE):
            for b in (None, bias):
                product = sm.small_m_linear(x, weight, b, config)
                check_linear(product, x, weight, b)
                check_gated(sm.small_m_linear(x, weight, b, config, gated=True), product)
                assert torch.equal(sm.small_m_linear(x, weight, b, config, float32_out=True), product.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [3, 4])
def test_bias_and_odd_rows(dtype, m):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x, weight, bias = _inputs(gen, m, 1000, 4096 + 24, dtype, bias=True)
    with torch.inference_mode(), reports_seed(seed):
        for config in sm.candidate_configs(m, 1000, 4096 + 24, DEVICE):
            check_linear(sm.small_m_linear(x, weight, bias, config), x, weight, bias)


def test_launches_do_not_sync_and_replay_in_a_cuda_graph():
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dtype, m, n, k = torch.bfloat16, 4, 4096, 4096
    x, weight, bias = _inputs(gen, m, n, k, dtype, bias=True)
    configs = sm.candidate_configs(m, n, k, DEVICE)

    def step():
        return [sm.small_m_linear(x, weight, bias, c) for c in configs]

    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compiles
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        with reports_seed(seed):
            for _ in range(2):
                x.copy_(torch.randn(m, k, generator=gen, device=DEVICE).to(dtype))
                graph.replay()
                for got, want in zip(static_out, step()):
                    assert torch.equal(got, want)  # same kernels, same inputs: deterministic


@pytest.mark.parametrize("m", [1, 4])
def test_a_chain_of_dependent_launches_waits_for_each_input(m):
    """Seven GEMVs (one gated: an MLP's gate_up), each reading the one before (a torch op between some), replayed in a CUDA graph:
    float32 against float64 (fixtures/float64_linear.check_dependent_chain)."""
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    with reports_seed(seed):
        check_dependent_chain(lambda i, h, w, gated: sm.small_m_linear(h, w, None, None, gated=gated),
                              m, torch.float32, gen, [4096, 6144, 4096, 14336, 4096, 4096, 4096, 8192],
                              plain_scale=2.0, input_scale=3.0, rtol=1e-4)


def test_dispatch_times_real_layers_and_keeps_choices_in_capture():
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(
        [Linear(k, n, dtype=torch.bfloat16, device=DEVICE) for n, k in LLAMA8B_SHAPES[:2]]
    )
    for p in layers.parameters():
        p.data.normal_(std=0.02)
    with torch.inference_mode(), reports_seed(seed):
        gemm = prepare_small_m_linears(layers, max_m=4)
        assert isinstance(gemm, SmallMGemm) and all(layer.small_m is gemm for layer in layers)
        assert len(gemm.choices) == 2 * 3 and len(gemm.timings) == 6  # M buckets 1, 2, 4
        print(gemm.summary())
        x = torch.randn(4, 4096, device=DEVICE).to(torch.bfloat16)
        eager = [layer(x) for layer in layers]
        for layer, got in zip(layers, eager):
            torch.testing.assert_close(got.float(), F.linear(x, layer.weight).float(), rtol=1.6e-2, atol=1e-2)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = [layer(x) for layer in layers]
        graph.replay()
        for layer, got, want in zip(layers, captured, eager):
            if gemm.choices[GemmKey(4, *layer.weight.shape, torch.bfloat16, False)] is not None:
                assert torch.equal(got, want)  # the capture took the same (cached) kernel
            else:
                torch.testing.assert_close(got, want)  # cuBLAS, maybe another algorithm


PROMPTS = ["The cat reads the book. The cat", "def add(x):\n    return", "a b a b a b", "Question:"]


def _generate(folder, mode, **kwargs):
    llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
              small_m_gemm=mode, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("checkpoint", ["qwen3_checkpoint", "llama31_checkpoint"])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_greedy_tokens_unchanged_by_the_kernel(checkpoint, spec, request):
    folder = request.getfixturevalue(checkpoint)
    off_llm, off = _generate(folder, "off", speculative_config=spec)
    assert off_llm.engine.runner.small_m_gemm is None
    on_llm, on = _generate(folder, "on", speculative_config=spec)
    gemm = on_llm.engine.runner.small_m_gemm
    assert gemm is not None and gemm.choices
    assert all(c is not None for key, c in gemm.choices.items() if key.m_bucket == 1)  # float32: the GEMV
    assert all(c is None for key, c in gemm.choices.items() if key.m_bucket > 1)  # and cuBLAS above
    assert on == off
    _, auto = _generate(folder, "auto", speculative_config=spec)
    assert auto == off
