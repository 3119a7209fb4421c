"""The batch-invariant linear (issue 23): row r computed at M = 1 equals row r computed among M = 2..64
rows, bit for bit, in the torch path (ops/gemm/batch_invariant.py: what the CPU runs) and in the
Triton kernel (ops/gemm/triton_batch_invariant.py, in Triton's interpreter on a CPU machine: float32
and float16, as its bf16 dot is broken), at every BLOCK_N (rows of W a program owns: 16, 32, 64 and
128); both agree with a float64 reference within rounding; bad inputs are refused with the value named. The default F.linear is shown to differ by M (float32
on this CPU), so the property is not free.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fixtures.order_fixed_dot import order_fixed_dot  # noqa: F401  (a fixture: tl.dot summed in K order)
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
BLOCK_NS = [16, 32, 64]  # rows of W a program owns (16 and 32: mma.sync on Hopper; 64: wgmma)


@pytest.fixture(scope="module")
def kernel():
    return import_interpreted("foretell.ops.gemm.triton_batch_invariant")


DEVICE = "cuda" if HAS_CUDA else "cpu"


ROW_COUNTS = (2, 17, 65, 130)  # row tiles of 16, 64 and 128 rows


CHECKED_ROWS = (0, 1, 4, 15, 16, 33, 39, 63, 64, 100, 129)  # first, last and middle slots of the tiles


def assert_kernel_rows_invariant(run, x: torch.Tensor, row_counts=ROW_COUNTS) -> None:
    """run(x[:M]) row r == run(x[r:r+1]) bitwise, for each M of row_counts and each checked r < M."""
    alone = {r: run(x[r : r + 1].clone()) for r in CHECKED_ROWS if r < max(row_counts)}
    for m in row_counts:
        together = run(x[:m].clone())
        for r in (r for r in CHECKED_ROWS if r < m):
            assert torch.equal(together[r : r + 1], alone[r]), f"row {r} differs at M={m}"


@pytest.mark.parametrize("block_n", BLOCK_NS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n,k,gated,float32_out,bias", [
    (96, 64, False, False, True),  # one K step, a ragged N tile
    (64, 200, False, True, False),  # K not a multiple of BLOCK_K; the LM head's float32
    (128, 72, True, False, False),  # gated [gate; up]
])
def test_kernel_rows_do_not_depend_on_m(kernel, order_fixed_dot, dtype, n, k, gated, float32_out, bias, block_n):
    """The mode's (BLOCK_K, SPLIT) for the shape at each BLOCK_N: row r alone equals row r among
    2..40 rows (row tiles of 16 and 64), and the rows agree with the float64 twin within rounding."""
    x, w, b = operands(n, k, 40, dtype, seed=3, device=DEVICE)
    config = replace(kernel.pick_shape_config(n, k, dtype, x.device), block_n=block_n)
    run = lambda rows: kernel.linear_batch_invariant_triton(  # noqa: E731
        rows, w, b if bias else None, gated=gated, float32_out=float32_out, config=config)
    assert_kernel_rows_invariant(run, x, row_counts=(2, 5, 16, 17, 40))
    want = linear_batch_invariant_torch(x.double(), w.double(), b.double() if bias else None, gated=gated)
    got = run(x).double()
    assert got.shape == want.shape
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    assert torch.allclose(got, want, atol=tol, rtol=tol)


# The wgmma tile in both dtypes; 16 and 32 rows once each (the dtype does not meet BLOCK_N in the kernel,
# and the interpreter's time goes by programs: 16-row tiles run four times as many).
@pytest.mark.parametrize("dtype,block_n", [(torch.float16, 64), (torch.float32, 64), (torch.float32, 16),
                                           (torch.float16, 32)])
@pytest.mark.parametrize("split,block_k,k,gated,float32_out", [
    (3, 16, 100, False, False),  # ragged slices: [0, 48), [48, 96), [96, 100)
    (4, 32, 256, True, False),  # the o / down choice, gated epilogue after the split-order sum
    (2, 16, 72, False, True),  # the LM head's float32 sum
])
def test_split_k_rows_do_not_depend_on_m(kernel, order_fixed_dot, dtype, split, block_k, k, gated, float32_out,
                                         block_n):
    """Split-K whose slices and merge order are fixed by (N, K) is batch-invariant at each BLOCK_N:
    row r alone equals row r among 2..130 rows (row tiles of 16, 64 and 128), and the sum stays
    within rounding."""
    from foretell.ops.common.split_counters import SplitCounters

    x, w, b = operands(96, k, 130, dtype, seed=5, device=DEVICE)
    config = kernel.ShapeConfig(block_k=block_k, split=split, block_n=block_n)
    counters = SplitCounters(min_count=64)
    run = lambda rows: kernel.linear_batch_invariant_triton(  # noqa: E731
        rows, w, b, gated=gated, float32_out=float32_out, counters=counters, config=config)
    assert_kernel_rows_invariant(run, x, ROW_COUNTS if block_n == 64 else ROW_COUNTS[:3])  # (128-row tiles: once)
    assert not counters.get(x.device, 1).any(), "every merging program leaves its counter zero"
    want = linear_batch_invariant_torch(x.double(), w.double(), b.double(), gated=gated)
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    got = run(x).double()
    assert torch.allclose(got, want, atol=tol, rtol=tol)
    # the split sum is another order than one pass over K: not bitwise, within float32 rounding
    whole = kernel.linear_batch_invariant_triton(x, w, b, gated=gated, float32_out=float32_out,
                                                 config=replace(config, split=1))
    assert torch.allclose(got, whole.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_row_tile_size_does_not_change_a_row(kernel, order_fixed_dot, dtype):
    """The claim the kernel rests on: with BLOCK_K and the dtype fixed, a row's bits are the same in a
    16-, 32-, 64- or 128-row tile (each K step is the same dot per element, the steps in one order)."""
    x, w, b = operands(128, 200, 64, dtype, seed=7, device=DEVICE)
    config = kernel.ShapeConfig(block_k=32, split=2)
    outs = [kernel.linear_batch_invariant_triton(x, w, b, config=config, fixed_block_m=bm) for bm in (16, 32, 64, 128)]
    # The pipeline depth is a launch choice too (check_batch_invariant_gpu.py --sections kernels sweeps it).
    outs += [kernel.linear_batch_invariant_triton(x, w, b, config=config, num_stages=stages) for stages in (1, 2)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU 16- and 32-row tiles may run mma.sync, 64 wgmma: other bits allowed")
def test_block_n_does_not_enter_the_sum_order(kernel, order_fixed_dot):
    """With a dot that sums each chunk in K order (fixtures/order_fixed_dot.py), 16-, 32-, 64- and
    128-row tiles of W give the same bits, plain, gated and split: BLOCK_N only decides which
    outputs a program writes; only the tensor-core instruction a tile size picks could differ."""
    x, w, b = operands(128, 200, 20, torch.float32, seed=11)
    for split, gated in ((1, False), (2, True)):
        outs = [kernel.linear_batch_invariant_triton(x, w, b, gated=gated,
                                                     config=kernel.ShapeConfig(32, split, block_n))
                for block_n in (16, 32, 64, 128)]
        for out in outs[1:]:
            assert torch.equal(out, outs[0])


@pytest.mark.skipif(HAS_CUDA, reason="about the interpreter's numpy dot")
def test_the_interpreters_own_dot_depends_on_the_tile(kernel, interpreter_mode):
    """Why order_fixed_dot (fixtures/order_fixed_dot.py) exists: with the interpreter's numpy dot, 16- and 64-row tiles give a
    row other bits, so the interpreter cannot speak for the tensor cores (the GPU test does)."""
    x, w, _ = operands(128, 256, 64, torch.float32, seed=7)
    config = kernel.ShapeConfig(block_k=128, split=1)
    small, large = (kernel.linear_batch_invariant_triton(x, w, config=config, fixed_block_m=bm) for bm in (16, 64))
    assert torch.allclose(small, large, atol=1e-5, rtol=1e-5)
    if not numpy_matmul_varies_with_rows():
        pytest.skip("this machine's numpy float32 matmul gives a row the same bits in 16- and 64-row tiles")
    assert not torch.equal(small, large)


def numpy_matmul_varies_with_rows() -> bool:
    """Whether numpy's float32 matmul (what the interpreter's tl.dot runs) gives the first 16 rows
    of a [64, 128] x [128, 64] product other bits than the [16, 128] product alone: on some CPUs'
    BLAS it does (the EPYC this test was written on), on others (an AVX-512 Xeon) it does not."""
    import numpy as np

    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((64, 128), dtype=np.float32), rng.standard_normal((128, 64), dtype=np.float32)
    return not np.array_equal(a[:16] @ b, (a @ b)[:16])


def test_long_prefills_run_in_launches_of_bounded_rows(kernel, order_fixed_dot, monkeypatch):
    x, w, b = operands(64, 96, 40, torch.float32, seed=9, device=DEVICE)
    config = kernel.ShapeConfig(block_k=32, split=3)
    whole = kernel.linear_batch_invariant_triton(x, w, b, config=config)
    monkeypatch.setattr(kernel, "MAX_SPLIT_ROWS", 16)  # three launches of 16, 16 and 8 rows
    assert torch.equal(kernel.linear_batch_invariant_triton(x, w, b, config=config), whole)


def test_shape_configs_for_llama8b_never_see_m(kernel):
    """The table in pick_shape_config's docstring (bf16 on a 132-multiprocessor device)."""
    cpu = torch.device("cpu")  # device_limits: 132 multiprocessors, as the H100 / H200
    table = {(6144, 4096): (256, 1), (4096, 4096): (128, 4), (28672, 4096): (128, 1), (4096, 14336): (128, 4),
             (128256, 4096): (128, 1)}
    for (n, k), (block_k, split) in table.items():
        assert kernel.pick_shape_config(n, k, torch.bfloat16, cpu) == kernel.ShapeConfig(block_k, split, 64)
    # the same rule at other tile heights (the sweep's BLOCK_N candidates): tiles against 132 SMs
    assert kernel.shape_config_for_tile(4096, 4096, torch.bfloat16, cpu, 32) == kernel.ShapeConfig(256, 1, 32)
    assert kernel.shape_config_for_tile(6144, 4096, torch.bfloat16, cpu, 16) == kernel.ShapeConfig(128, 1, 16)
    assert kernel.shape_config_for_tile(6144, 4096, torch.bfloat16, cpu, 128) == kernel.ShapeConfig(128, 4, 128)
    assert kernel.pick_shape_config(4096, 4096, torch.float32, cpu).block_k == 32
    with pytest.raises(ValueError, match="N >= 1 and K >= 1"):
        kernel.pick_shape_config(0, 4096, torch.bfloat16, cpu)


def test_kernel_refuses_bad_inputs(kernel, interpreter_mode):
    x, w, _ = operands(32, 16, 2, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="share a dtype"):
        kernel.linear_batch_invariant_triton(x, w.half())
    with pytest.raises(ValueError, match="must be contiguous"):
        kernel.linear_batch_invariant_triton(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="fixed_block_m must be 16, 32, 64 or 128"):
        kernel.linear_batch_invariant_triton(x, w, fixed_block_m=24)
    with pytest.raises(ValueError, match="num_stages must be 1 to 8"):
        kernel.linear_batch_invariant_triton(x, w, num_stages=0)


@pytest.mark.parametrize("block_n", [24, 8, 0, -64])
def test_block_n_must_be_a_power_of_two_of_at_least_16(kernel, block_n):
    with pytest.raises(ValueError, match=rf"ShapeConfig.block_n must be a power of two of at least 16.*got {block_n}"):
        kernel.ShapeConfig(block_k=32, split=1, block_n=block_n)


def test_shape_config_refuses_bad_steps_and_splits(kernel):
    with pytest.raises(ValueError, match="ShapeConfig.block_k must be a power of two of at least 16, got 48"):
        kernel.ShapeConfig(block_k=48, split=1)
    with pytest.raises(ValueError, match="ShapeConfig.split must be 1 or more, got 0"):
        kernel.ShapeConfig(block_k=32, split=0)
    assert str(kernel.ShapeConfig(128, 4)) == "invariant BK128 split4"  # the mode's tile: names as before
    assert str(kernel.ShapeConfig(128, 4, 32)) == "invariant BK128 split4 BN32"
