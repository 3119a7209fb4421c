"""The low-precision kernels (issue 25: FP8 linears and their activation quantizer, the int4 MoE
GEMVs) compile for an H100/H200 (sm_90) without a GPU, at the shapes the engine launches them with
(DeepSeek-V3 / Kimi-K2 128x128 blocks, Kimi-K2.5 int4 experts), in one fresh process
(fixtures/kernel_compile_low_precision.py), as tests/ops/test_kernels_compile_sm90.py does for the
others. Correctness is the interpreter tests' and tests/gpu's job. Skipped when this Triton cannot
compile for CUDA on this machine.
"""

from __future__ import annotations

import importlib.util

import pytest

from fixtures.sm90_compile import compile_cases

if importlib.util.find_spec("triton") is None:  # looked up, not imported (see test_kernels_compile_sm90.py)
    pytest.skip("needs triton", allow_module_level=True)

CASES = [
    "fp8 gemv, 128x128 blocks, DeepSeek-V3 q_a (1 row, pdl)", "fp8 gemv, 128x128 blocks, 4 rows, bias",
    "fp8 gemv, 128x128 blocks, gated, split-K 2 (1 row, pdl)", "fp8 gemv, per channel (1 row, pdl)",
    "fp8 mma, 128x128 blocks, 16 rows (pdl)", "fp8 mma, 128x128 blocks, gated, split-K 4 (pdl)",
    "fp8 mma, per channel, bias", "fp8 half gemv, 128x128 blocks, gated (1 row, pdl)",
    "fp8 half gemv, per channel, bias, split 2",
    "fp8 activation quantizer, per token group of 128", "fp8 gemm, 128x128 blocks, 128x128 tiles",
    "fp8 gemm, per channel, bias, 64-row tiles", "int4 moe gemv gate_up, Kimi-K2.5",
    "int4 moe gemv down + combine, Kimi-K2.5, slot split", "int4 moe gemv down + combine, unsplit",
    "int4 moe gemv gate_up over x's lanes, Kimi-K2.5", "int4 x lanes",
    "int4 moe gemv down + combine over act's lanes, Kimi-K2.5, slot split",
    "fp8 moe gemv gate_up, scales on x, DeepSeek-V3", "fp8 moe gemv gate_up, each weight scaled",
    "fp8 moe gemv down + combine, scales on act, slot split",
]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_cases("fixtures.kernel_compile_low_precision")


def test_every_case_was_compiled(compiled):
    assert sorted(compiled) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90(compiled, case):
    assert compiled[case] == "ok", compiled[case]
