"""The tensor-core few-row linear (ops/gemm/triton_mma.py) against a float64 torch reference.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors in fp16 (the
interpreter's tl.dot is wrong on bf16; bf16 is checked on CUDA in tests/gpu/test_gemm_gemv_gpu.py).
Outputs and float32 partials are poisoned with NaN, so a kernel that skips an element, or sums a
partial nobody wrote, shows it. Every case draws fresh shapes and inputs; a failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.float64_linear import check_gated, check_linear, poisoned_empty  # noqa: F401 (a fixture)
from fixtures.seeds import reports_seed  # noqa: E402

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
mma = import_interpreted("foretell.ops.gemm.triton_mma")


def _counters_zero():
    buffers = mma._COUNTERS._buffers.values()
    return all(int(b.count_nonzero()) == 0 for b in buffers)


@pytest.mark.parametrize("m", [1, 3, 4, 16])
def test_matches_float64_reference_for_each_split(m, poisoned_empty):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, k = rng.randint(65, 150), rng.randint(300, 700)  # neither a multiple of the tiles
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).half().to(DEVICE)
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    with reports_seed(seed):
        for split, block_k in ((1, 64), (2, 64), (4, 32), (3, 128)):  # uneven slices, the last partly past K
            config = mma.MmaConfig(block_k, split, num_stages=2)
            for b in (bias, None):
                check_linear(mma.small_m_mma_linear(x, weight, b, config), x, weight, b)
                assert _counters_zero(), "a split launch left its counters set"


def test_gated_output_is_the_activation_of_the_product(poisoned_empty):
    """gated=True (W = [gate; up]): each 64-row tile holds 32 (gate j, up j) pairs; unsplit and
    split-K (the activation taken by the split that merges). float32_out: the product's values in
    float32."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m, inter, k = rng.randint(1, 16), rng.randint(40, 90), rng.randint(100, 300)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    weight = (torch.randn(2 * inter, k, generator=gen) * 3 / k**0.5).half().to(DEVICE)
    bias = torch.randn(2 * inter, generator=gen).half().to(DEVICE)
    with reports_seed(seed):
        for config in (mma.MmaConfig(64, 1, 2), mma.MmaConfig(32, 3, 2)):
            product = mma.small_m_mma_linear(x, weight, bias, config)
            check_linear(product, x, weight, bias)
            check_gated(mma.small_m_mma_linear(x, weight, bias, config, gated=True), product)
            assert torch.equal(mma.small_m_mma_linear(x, weight, bias, config, float32_out=True), product.float())
            assert _counters_zero()


def test_strided_rows_and_default_config(poisoned_empty):
    x = torch.randn(5, 200, dtype=torch.float16, device=DEVICE)[:, 30:130]  # row stride 200, K = 100
    weight = torch.randn(70, 100, dtype=torch.float16, device=DEVICE)
    check_linear(mma.small_m_mma_linear(x, weight), x, weight, None)
    # 8 slices of 16 over K = 100: slice 6 is partly past K, slice 7 wholly (it must still arrive).
    check_linear(mma.small_m_mma_linear(x, weight, None, mma.MmaConfig(16, 8, 1)), x, weight, None)
    assert _counters_zero()


def test_configs_split_few_tiles_and_fit_shared_memory():
    cpu = torch.device("cpu")  # 132 multiprocessors, 99 KiB of shared memory
    # Llama-8B on an H100-sized grid (the H200 sweep): o / down split 4 ways, qkv whole rows of 256.
    assert mma.pick_config(4, 4096, 4096, cpu).split == 4
    assert mma.pick_config(4, 4096, 14336, cpu).split == 4
    assert mma.pick_config(4, 6144, 8192, cpu).split == 2  # an EAGLE3 head's qkv: 96 tiles, a long K
    qkv = mma.pick_config(4, 6144, 4096, cpu)
    assert (qkv.split, qkv.block_k) == (1, 256)
    assert mma.pick_config(4, 28672, 4096, cpu) == mma.MmaConfig(128, 1, 3)  # gate_up
    rng = random.Random(0)
    for _ in range(300):
        m, n, k = rng.randint(1, 16), rng.randint(1, 50000), rng.randint(1, 20000)
        for config in mma.candidate_configs(m, n, k, cpu):
            assert config.num_stages >= 1 and config.split in (1, 2, 4)
            per_stage = (config.block_n + mma.MAX_M) * config.block_k * 2
            assert config.num_stages == 1 or (config.num_stages + 1) * per_stage <= mma.DEFAULT_SMEM_BYTES


def test_bad_inputs_raise_clear_errors():
    x, w = torch.zeros(2, 8).half(), torch.zeros(4, 8).half()
    with pytest.raises(ValueError, match=r"K=8\], got \[2, 9\]"):
        mma.small_m_mma_linear(torch.zeros(2, 9).half(), w)
    with pytest.raises(ValueError, match="contiguous"):
        mma.small_m_mma_linear(x, torch.zeros(8, 4).half().t())
    with pytest.raises(ValueError, match="tensor-core inputs"):
        mma.small_m_mma_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="dtype"):
        mma.small_m_mma_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="bias"):
        mma.small_m_mma_linear(x, w, torch.zeros(3).half())
    with pytest.raises(ValueError, match="1 to 16 rows"):
        mma.small_m_mma_linear(torch.zeros(17, 8).half(), w)
    with pytest.raises(ValueError, match="even number of rows"):
        mma.small_m_mma_linear(x, torch.zeros(5, 8).half(), gated=True)
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        mma.pick_config(0, 4, 8, torch.device("cpu"))
