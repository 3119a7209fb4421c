"""The one-row FP8 GEMV with half-precision products (ops/gemm/triton_fp8_gemv_half.py) against
float64 products, in Triton's interpreter on CPU (fp16 x: the interpreter keeps bf16 as uint16; bf16
and the real shapes are tests/gpu/test_gemm_fp8_gpu.py's): ragged shapes, block and per-channel
scales, splits of K, the gated epilogue, x of very large and very small magnitude (the power of two
that keeps x s in fp16's range), and bad configs. Outputs are poisoned with NaN (a skipped element
shows); every case draws a fresh seed and a failure prints it.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.float64_linear import poisoned_empty  # noqa: F401 (a fixture)
from fixtures.fp8_linear import check_gated, check_product, half_tiles, random_fp8_weight
from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import (  # noqa: F401 (interpreter_mode: a fixture)
    HAS_CUDA, import_fp8_few_rows, import_interpreted, interpreter_mode,
)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
few = import_fp8_few_rows()
fp8_gemv = import_interpreted("foretell.ops.gemm.triton_fp8_gemv")  # (interpreted by the line above)
half = import_interpreted("foretell.ops.gemm.triton_fp8_gemv_half")  # (interpreted by the line above)
BLOCK = (128, 128)


@pytest.mark.parametrize("block_size", [BLOCK, (16, 64), None], ids=["128x128", "16x64", "channel"])
@pytest.mark.parametrize("split", [1, 3])
def test_matches_float64(block_size, split, poisoned_empty):
    """Ragged N and K (a partial last block, tiles not dividing K) and K in whole tiles (EVEN_K),
    with and without a bias, one slice of K and three (summed by the last split, counters zeroed)."""
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n = 16 * rng.randint(1, 4) if block_size == (16, 64) else rng.randint(5, 60)
    with reports_seed(seed):
        for k in (rng.randint(129, 700), 768):
            q, s = random_fp8_weight(gen, n, k, block_size, DEVICE)
            x = torch.randn(1, k, generator=gen).half().to(DEVICE)
            bias = torch.randn(n, generator=gen).half().to(DEVICE)
            block_n = 16 if block_size == (16, 64) else 8
            config = half.Fp8HalfGemvConfig(block_n, 64, 1, split)
            for b in (bias, None):
                got = few.fp8_few_rows_linear(x, q, s, block_size, b, config)
                check_product(got, x, q, s, block_size, b, torch.float16, half_tiles(config, k))
            assert not few._COUNTERS.get(torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("block_size", [BLOCK, None], ids=["128x128", "channel"])
@pytest.mark.parametrize("magnitude", [300.0, 1e-3, 0.0])
def test_x_of_any_magnitude_stays_in_range(block_size, magnitude, poisoned_empty):
    """x whose largest element would overflow fp16 products (3e4 x 448) or sit in its subnormals
    (1e-3 times small scales), one outlier 100x the rest, and an all-zero x: the power of two keeps
    every product in range (no inf, no NaN) and the result within the bound."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, k = 24, 1024
    q, s = random_fp8_weight(gen, n, k, block_size, DEVICE)
    x = torch.randn(1, k, generator=gen) * magnitude
    x[0, 17] = 100 * magnitude
    x = x.half().to(DEVICE)
    config = half.Fp8HalfGemvConfig(8, 64, 1)
    with reports_seed(seed):
        got = few.fp8_few_rows_linear(x, q, s, block_size, None, config)
        assert torch.isfinite(got).all()
        check_product(got, x, q, s, block_size, None, torch.float16, half_tiles(config, k))
        if magnitude == 0.0:
            assert not got.any()


@pytest.mark.parametrize("block_size", [BLOCK, (32, 64), None], ids=["128x128", "32x64", "channel"])
def test_gated_epilogue_is_silu_and_mul_of_the_product(block_size, poisoned_empty):
    """W = [gate; up]: gate rows and up rows as two tiles, each with its own scales row, sharing the
    program's power of two (so not the ungated call's sums bit for bit): silu(gate) * up within the
    bound of the gate and up sums, with and without split-K and a bias."""
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    inter = 128 if block_size == BLOCK else 32 * rng.randint(1, 3)
    k = rng.randint(129, 500)
    q, s = random_fp8_weight(gen, 2 * inter, k, block_size, DEVICE)
    x = torch.randn(1, k, generator=gen).half().to(DEVICE)
    bias = torch.randn(2 * inter, generator=gen).half().to(DEVICE)
    with reports_seed(seed):
        configs = (half.Fp8HalfGemvConfig(16, 64, 1), half.Fp8HalfGemvConfig(16, 32, 1, 2))
        for config, b in zip(configs, (None, bias)):
            plain = few.fp8_few_rows_linear(x, q, s, block_size, b, config)  # [1, 2I]
            check_product(plain, x, q, s, block_size, b, torch.float16, half_tiles(config, k))
            gated = few.fp8_few_rows_linear(x, q, s, block_size, b, config, gated=True)  # [1, I]
            check_gated(gated, x, q, s, block_size, b, torch.float16, half_tiles(config, k))


def test_float32_out_is_the_rounded_product(poisoned_empty):
    gen = torch.Generator().manual_seed(3)
    q, s = random_fp8_weight(gen, 40, 300, BLOCK, DEVICE)
    x = torch.randn(1, 300, generator=gen).half().to(DEVICE)
    config = half.Fp8HalfGemvConfig(8, 64, 1)
    out32 = few.fp8_few_rows_linear(x, q, s, BLOCK, None, config, float32_out=True)
    assert out32.dtype == torch.float32
    assert torch.equal(out32, few.fp8_few_rows_linear(x, q, s, BLOCK, None, config).float())


def test_default_at_one_row_of_half_x_and_the_sweeps_candidates(poisoned_empty):
    """One row of fp16 / bf16 x takes this kernel by default (16 x 1024 over four warps: the H200
    sweep's winner); a float32 x and more rows keep the float32 GEMV / the MMA; every half candidate
    the H200 sweep times computes the product."""
    cpu = torch.device("cpu")
    config = half.Fp8HalfGemvConfig
    for n, k, want in ((6144, 4096, config(16, 1024, 4)), (28672, 4096, config(16, 1024, 4)),
                       (4096, 14336, config(16, 1024, 4)), (64, 100, config(16, 128, 4))):
        assert few.default_config(1, n, k, torch.bfloat16, BLOCK, cpu) == want, (n, k)
    assert isinstance(few.default_config(1, 6144, 4096, torch.float32, BLOCK, cpu), fp8_gemv.Fp8GemvConfig)
    assert isinstance(few.default_config(2, 6144, 4096, torch.bfloat16, BLOCK, cpu), few.Fp8MmaConfig)
    # blocks of 4 rows: no half tile fits, so the float32 GEMV's four rows
    assert isinstance(few.default_config(1, 8192, 256, torch.bfloat16, (4, 128), cpu), fp8_gemv.Fp8GemvConfig)
    gen = torch.Generator().manual_seed(7)
    n, k = 64, 512
    q, s = random_fp8_weight(gen, n, k, BLOCK, DEVICE)
    x = torch.randn(1, k, generator=gen).half().to(DEVICE)
    configs = [c for c in few.candidate_configs(1, n, k, torch.float16, BLOCK, DEVICE)
               if isinstance(c, half.Fp8HalfGemvConfig)]
    assert len(configs) >= 5
    for config in configs:
        check_product(few.fp8_few_rows_linear(x, q, s, BLOCK, None, config), x, q, s, BLOCK, None, torch.float16,
                      half_tiles(config, k))


def test_bad_inputs_raise_clear_errors():
    gen = torch.Generator().manual_seed(1)
    q, s = random_fp8_weight(gen, 32, 256, BLOCK, DEVICE)
    x = torch.randn(1, 256).half().to(DEVICE)
    with pytest.raises(ValueError, match="1 to 1 rows"):
        two_rows = torch.randn(2, 256).half().to(DEVICE)
        few.fp8_few_rows_linear(two_rows, q, s, BLOCK, None, half.Fp8HalfGemvConfig(8, 64, 1))
    with pytest.raises(ValueError, match="takes x in"):
        few.fp8_few_rows_linear(x.float(), q, s, BLOCK, None, half.Fp8HalfGemvConfig(8, 64, 1))
    with pytest.raises(ValueError, match="even block_n"):
        few.fp8_few_rows_linear(x, q, s, BLOCK, None, half.Fp8HalfGemvConfig(7, 64, 1), gated=True)
    with pytest.raises(ValueError, match="one block row"):
        q4, s4 = random_fp8_weight(gen, 32, 256, (4, 128), DEVICE)
        few.fp8_few_rows_linear(x, q4, s4, (4, 128), None, half.Fp8HalfGemvConfig(8, 64, 1))
    with pytest.raises(ValueError, match="N >= 1"):
        half.half_gemv_config(0, 256)


def test_max_exponent_keeps_a_lanes_sum_within_fp16():
    for tiles in (1, 2, 8, 14, 28, 100):
        e = half.max_exponent(tiles)
        assert tiles * 448 * 2.0**e <= 65504 < tiles * 448 * 2.0 ** (e + 1)
