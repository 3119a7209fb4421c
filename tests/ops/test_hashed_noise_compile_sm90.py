"""The hashed-noise kernels compile for an H100/H200 (sm_90) without a GPU, and their PTX divides and
takes logarithms the exact way (fixtures/kernel_compile_hashed_noise.py, in a fresh process).
Correctness is tests/ops/test_hashed_noise_triton.py's and tests/gpu's job. Skipped when this Triton
cannot compile for CUDA on this machine.
"""

from __future__ import annotations

import importlib.util

import pytest

from fixtures.sm90_compile import compile_cases

if importlib.util.find_spec("triton") is None:  # looked up, not imported (see test_kernels_compile_sm90.py)
    pytest.skip("needs triton", allow_module_level=True)

CASES = ["row seeds", "uniform noise", "exponential noise", "exponential race chunks"]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_cases("fixtures.kernel_compile_hashed_noise")


def test_every_case_was_compiled(compiled):
    assert sorted(compiled) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90_with_exact_arithmetic(compiled, case):
    assert compiled[case] == "ok", compiled[case]
