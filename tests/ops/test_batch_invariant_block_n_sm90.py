"""The batch-invariant linear compiles for an H100/H200 (sm_90) without a GPU at every BLOCK_N the
in-graph sweep tries (16, 32, 64, 128 rows of W a program), and a K chunk is reduced by mma.sync at
16 and 32 rows, by wgmma at 64 and 128 (fixtures/kernel_compile_block_n.py, in a fresh process): the
reason a BLOCK_N is chosen per weight shape (N, K), never per M. Bits across BLOCK_N and M on the
device are tests/gpu's job. Skipped when this Triton cannot compile for CUDA on this machine.
"""

from __future__ import annotations

import importlib.util

import pytest

from fixtures.sm90_compile import compile_cases

if importlib.util.find_spec("triton") is None:  # looked up, not imported (see test_kernels_compile_sm90.py)
    pytest.skip("needs triton", allow_module_level=True)

CASES = ["BLOCK_N 16, Llama qkv decode (BK 256)", "BLOCK_N 32, gated, split-K 4, 64-row tiles",
         "BLOCK_N 64, decode (the mode's)", "BLOCK_N 128, split-K 4, decode"]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_cases("fixtures.kernel_compile_block_n")


def test_every_case_was_compiled(compiled):
    assert sorted(compiled) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_block_n_picks_the_chunks_mma_instruction(compiled, case):
    assert compiled[case] == "ok", compiled[case]
