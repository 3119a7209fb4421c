"""The batch-invariant linear (issue 23): row r computed at M = 1 equals row r computed among M = 2..64
rows, bit for bit, in the torch path (ops/gemm/batch_invariant.py: what the CPU runs) and in the
Triton kernel (ops/gemm/triton_batch_invariant.py, in Triton's interpreter on a CPU machine: float32
and float16, as its bf16 dot is broken); both agree with a float64 reference within rounding;
bad inputs are refused with the value named. The default F.linear is shown to differ by M (float32
on this CPU), so the property is not free.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.gemm.batch_invariant import BatchInvariantGemm, linear_batch_invariant_torch, linear_rows_torch
from foretell.ops.pointwise.batch_invariant import silu_and_mul_batch_invariant

M_VALUES = [2, 3, 4, 5, 8, 15, 16, 17, 33, 64]


def operands(n: int, k: int, m: int, dtype, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)  # [M, K]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)  # [N, K]
    b = torch.randn(n, generator=gen).to(dtype).to(device)  # [N]
    return x, w, b


def assert_rows_invariant(fn, x: torch.Tensor) -> None:
    """fn(x[:M]) row r == fn(x[r:r+1]) for every M and r < M (bitwise)."""
    alone = [fn(x[r : r + 1].clone()) for r in range(x.shape[0])]
    for m in M_VALUES:
        together = fn(x[:m])
        for r in range(m):
            assert torch.equal(together[r : r + 1], alone[r]), f"row {r} differs at M={m}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 64), (384, 256), (1536, 256), (40, 37)])
def test_torch_rows_do_not_depend_on_m(dtype, n, k):
    x, w, b = operands(n, k, 64, dtype)
    assert_rows_invariant(lambda rows: linear_batch_invariant_torch(rows, w, b), x)
    assert_rows_invariant(lambda rows: linear_batch_invariant_torch(rows, w, None, gated=True), x)
    assert_rows_invariant(lambda rows: linear_batch_invariant_torch(rows, w, None, float32_out=True), x)


def test_default_float32_linear_does_depend_on_m():
    """Why the mode exists: on this CPU F.linear's float32 row 0 differs between M = 1 and M = 2."""
    x, w, _ = operands(1536, 256, 64, torch.float32)
    assert any(not torch.equal(F.linear(x[:m], w)[:1], F.linear(x[:1].clone(), w)) for m in M_VALUES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_matches_float64(dtype):
    x, w, b = operands(300, 128, 20, dtype)
    want = F.linear(x.double(), w.double(), b.double())
    got = linear_batch_invariant_torch(x, w, b).double()
    # a rounding of the product and one of the bias sum, plus float32 sums over K
    eps = torch.finfo(dtype).eps
    tol = 2 * eps * (F.linear(x.double(), w.double()).abs() + b.double().abs()) + 1e-5 * 128**0.5
    assert ((got - want).abs() <= tol).all()
    logits = linear_batch_invariant_torch(x, w, None, float32_out=True)  # the LM head: float32, unrounded
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), F.linear(x.double(), w.double()), atol=1e-5, rtol=1e-5)
    gated = linear_batch_invariant_torch(x, w, b, gated=True)  # [gate; up] -> silu(gate) * up
    full = linear_batch_invariant_torch(x, w, b)
    assert torch.equal(gated, silu_and_mul_batch_invariant(full))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[N, K\] with the same K"):
        linear_rows_torch(torch.zeros(2, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="even number of rows"):
        linear_batch_invariant_torch(torch.zeros(2, 3), torch.zeros(5, 3), gated=True)


def test_gemm_on_cpu_runs_the_torch_rows():
    x, w, b = operands(96, 64, 7, torch.bfloat16)
    assert torch.equal(BatchInvariantGemm()(x.view(7, 1, 64), w, b), linear_batch_invariant_torch(x, w, b).view(7, 1, 96))


# ------------------------------------------------------------------------------------ Triton

KERNEL_DTYPES = [torch.float16, torch.float32]  # the interpreter's bf16 dot is broken


@pytest.fixture(scope="module")
def kernel():
    return import_interpreted("foretell.ops.gemm.triton_batch_invariant")


DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n,k,gated,float32_out,bias", [
    (96, 64, False, False, True),  # one K step, a ragged N tile
    (64, 200, False, True, False),  # K not a multiple of BLOCK_K; the LM head's float32
    (128, 72, True, False, False),  # gated [gate; up]
])
def test_kernel_rows_do_not_depend_on_m(kernel, interpreter_mode, dtype, n, k, gated, float32_out, bias):
    x, w, b = operands(n, k, 40, dtype, seed=3, device=DEVICE)
    run = lambda rows: kernel.linear_batch_invariant_triton(  # noqa: E731
        rows, w, b if bias else None, gated=gated, float32_out=float32_out)
    alone = [run(x[r : r + 1].clone()) for r in range(x.shape[0])]
    for m in (2, 5, 16, 17, 40):
        together = run(x[:m])
        for r in range(m):
            assert torch.equal(together[r : r + 1], alone[r]), f"row {r} differs at M={m}"
    want = linear_batch_invariant_torch(x.double(), w.double(), b.double() if bias else None, gated=gated)
    got = run(x).double()
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    assert torch.allclose(got, want, atol=tol, rtol=tol)


def test_kernel_refuses_bad_inputs(kernel, interpreter_mode):
    x, w, _ = operands(32, 16, 2, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="share a dtype"):
        kernel.linear_batch_invariant_triton(x, w.half())
    with pytest.raises(ValueError, match="must be contiguous"):
        kernel.linear_batch_invariant_triton(x, w.t().contiguous().t())
