"""FP8-weight linears (issue 25): the torch twins (ops/gemm/fp8_reference.py) against float64
computations and the loader's dequantization, and the kernels (triton_fp8_few_rows.py,
triton_fp8_gemm.py) against float64 products of the twins' operands, in Triton's interpreter on
CPU (fp8 loads, stores and tl.dot work there; x in fp16 and fp32, as the interpreter keeps bf16 as
uint16: bf16 and the real shapes are tests/gpu/test_gemm_fp8_gpu.py's).

Shapes are ragged (N and K not multiples of 128, so the last scale block is partial) and inputs are
random and non-zero; kernel outputs are poisoned with NaN, so a skipped element shows. Every case
draws a fresh seed; a failure prints it.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures import deepseek as ds
from fixtures.float64_linear import poisoned_empty  # noqa: F401 (a fixture)
from fixtures.fp8_linear import check_product, random_fp8_weight
from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import (  # noqa: F401 (interpreter_mode: a fixture)
    HAS_CUDA, import_fp8_few_rows, import_interpreted, interpreter_mode,
)
from foretell.checkpoint_fp8 import dequantize_fp8_blocks
from foretell.ops.gemm import fp8_reference as ref
from foretell.ops.gemm.fp8_dispatch import fp8_linear, fp8_path
from foretell.ops.pointwise.reference import silu_and_mul_torch

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
few = import_fp8_few_rows()
fp8_gemv = import_interpreted("foretell.ops.gemm.triton_fp8_gemv")  # (interpreted by the line above)
gemm = import_interpreted("foretell.ops.gemm.triton_fp8_gemm")
BLOCK = (128, 128)


def _weight(gen, n, k, block_size):
    return random_fp8_weight(gen, n, k, block_size, DEVICE)


# ---------------------------------------------------------------------- the twins


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (7, 129), (1, 1)])
def test_dequantization_matches_the_loader_and_a_loop(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=gen) * 3
    q, scale = ref.quantize_fp8_blocks(weight, BLOCK)
    fixture_q, fixture_scale = ds.quantize_fp8_blocks(weight, list(BLOCK))  # the tests' own loop
    assert torch.equal(q.view(torch.uint8), fixture_q.view(torch.uint8)) and torch.equal(scale, fixture_scale)
    ours = ref.dequantize_fp8(q, scale, BLOCK)
    assert torch.equal(ours, ds.dequantize_reference(q, scale, list(BLOCK)))
    assert torch.equal(ours, dequantize_fp8_blocks(q, scale, BLOCK))
    assert (ours - weight).abs().max() <= weight.abs().max() / 8  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("block_size", [BLOCK, (64, 32), None], ids=["128x128", "64x32", "channel"])
def test_reference_linear_matches_float64(block_size):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, n, k = rng.randint(1, 20), rng.randint(129, 300), rng.randint(129, 400)
    q, s = _weight(gen, n, k, block_size)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, m, k, generator=gen).to(dtype)  # leading dimensions kept
        bias = torch.randn(n, generator=gen).to(dtype)
        got = ref.fp8_linear_torch(x, q.cpu(), s.cpu(), block_size, bias)
        assert got.shape == (2, m, n)
        with reports_seed(seed):
            check_product(got.reshape(-1, n), x.reshape(-1, k), q, s, block_size, bias, dtype)


def test_per_token_group_quantizer_maps_each_groups_amax_to_448():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    m, k = 5, 300  # groups of 128, 128, 44
    x = torch.randn(m, k, generator=gen) * torch.exp(3 * torch.randn(m, 1, generator=gen))
    x[3] = 0.0  # a zero row: zeros, not NaN
    x[4, 130:] = 0.0  # one group all zero, the first non-zero
    q, scales = ref.quantize_fp8_per_token_group(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and scales.shape == (m, 3)
    x64 = x.double()
    for g, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
        amax = x64[:, cols].abs().amax(dim=1)
        expected = amax.clamp(min=ref.MIN_AMAX) / 448
        assert torch.allclose(scales[:, g].double(), expected, rtol=2**-23, atol=0)
        values = q[:, cols].double() * scales[:, g, None].double()
        # round to nearest in e4m3: half a step (2^-4 of the value, or 2^-10 of the scale below 2^-6)
        bound = torch.maximum(x64[:, cols].abs() * 2.0**-4, scales[:, g, None].double() * 2.0**-10) * (1 + 1e-6)
        assert ((values - x64[:, cols]).abs() <= bound).all()
        peaks = q[:, cols].float().abs().amax(dim=1)
        assert torch.equal(peaks[amax > 0], torch.full_like(peaks[amax > 0], 448.0))
    assert not torch.isnan(q.float()).any() and (q[3].float() == 0).all()
    torch.testing.assert_close(ref.dequantize_per_token_group(q, scales), x, rtol=2**-4, atol=1e-6)


def test_per_channel_quantizer_keeps_each_row_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 70, generator=gen) * torch.exp(2 * torch.randn(40, 1, generator=gen))
    w[7] = 0.0
    q, scale = ref.quantize_fp8_per_channel(w.to(torch.bfloat16))
    assert q.shape == (40, 70) and scale.shape == (40, 1) and scale.dtype == torch.float32
    w64 = w.to(torch.bfloat16).double()
    assert torch.allclose(scale.double().squeeze(1), w64.abs().amax(1).clamp(min=ref.MIN_AMAX) / 448, rtol=2**-23)
    err = (q.double() * scale.double() - w64).abs()
    assert (err <= torch.maximum(w64.abs() * 2.0**-4, scale.double() * 2.0**-10) * (1 + 1e-6)).all()
    assert (q[7].float() == 0).all()
    with pytest.raises(ValueError, match=r"float \[N, K\]"):
        ref.quantize_fp8_per_channel(torch.zeros(3, 4, dtype=torch.int32))


def test_bad_weights_and_scales_raise_clear_errors():
    q, s = ref.quantize_fp8_blocks(torch.randn(200, 300), BLOCK)
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match=r"float32 \[2, 3\], got torch.float32 \[2, 2\]"):
        fp8_linear(x, q, s[:, :2], BLOCK)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, q.float(), s, BLOCK)
    with pytest.raises(ValueError, match=r"per-channel scale .* \[200, 1\]"):
        fp8_linear(x, q, s, None)
    with pytest.raises(ValueError, match=r"K=300"):
        fp8_linear(torch.randn(2, 299), q, s, BLOCK)
    with pytest.raises(ValueError, match="two positive integers"):
        fp8_linear(x, q, s, (128, 0))


def test_dispatch_on_cpu_is_the_twin_and_paths_by_rows():
    gen = torch.Generator().manual_seed(1)
    q, s = ref.quantize_fp8_blocks(torch.randn(130, 260, generator=gen), BLOCK)
    x = torch.randn(3, 2, 260, generator=gen)
    assert torch.equal(fp8_linear(x, q, s, BLOCK), ref.fp8_linear_torch(x, q, s, BLOCK))
    assert fp8_path(1, torch.bfloat16, BLOCK) == "few_rows"
    assert fp8_path(16, torch.bfloat16, BLOCK) == "few_rows"
    assert fp8_path(17, torch.bfloat16, BLOCK) == "gemm"
    assert fp8_path(3, torch.float32, None) == "few_rows"
    assert fp8_path(8, torch.float32, None) == "gemm"  # no tensor-core MMA of float32 x
    assert fp8_path(64, torch.bfloat16, (128, 64)) == "torch"  # activation groups are 128 wide
    assert fp8_path(2, torch.bfloat16, (128, 96)) == "torch"


# ---------------------------------------------------------------------- the kernels (interpreter)


@pytest.mark.parametrize("block_size", [BLOCK, None], ids=["128x128", "channel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_float64(block_size, dtype, m, poisoned_empty):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n, k = rng.randint(5, 40), rng.randint(129, 600)  # ragged: a partial last block
    q, s = _weight(gen, n, k, block_size)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    configs = [None, fp8_gemv.gemv_config(m, n, k, block_k=64), fp8_gemv.gemv_config(m, n, k, block_k=256, block_n=2)]
    with reports_seed(seed):
        for config, b in zip(configs, (bias, None, bias)):  # one tile of K, tiles narrower and wider than a block
            got = few.fp8_few_rows_linear(x, q, s, block_size, b, config)
            check_product(got, x, q, s, block_size, b, dtype)
        float32_out = few.fp8_few_rows_linear(x, q, s, block_size, bias, float32_out=True)
        assert torch.equal(float32_out, few.fp8_few_rows_linear(x, q, s, block_size, bias).float())


@pytest.mark.parametrize("block_size", [BLOCK, None], ids=["128x128", "channel"])
@pytest.mark.parametrize("m", [2, 5, 16])
def test_mma_matches_float64(block_size, m, poisoned_empty):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n, k = rng.randint(65, 150), rng.randint(129, 400)  # two 64-row tiles, the last partial
    q, s = _weight(gen, n, k, block_size)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    with reports_seed(seed):
        configs = (few.mma_config(k, block_size), few.Fp8MmaConfig(block_k=32, num_stages=2),
                   few.Fp8MmaConfig(block_k=32, num_stages=2, half_x=False))
        for config in configs:
            for b in (bias, None):
                check_product(few.fp8_few_rows_linear(x, q, s, block_size, b, config), x, q, s, block_size, b,
                              torch.float16)


@pytest.mark.parametrize("block_size", [BLOCK, (16, 64), None], ids=["128x128", "16x64", "channel"])
@pytest.mark.parametrize("kind, m, dtype", [("gemv", 1, torch.float16), ("gemv", 3, torch.float32),
                                            ("mma", 5, torch.float16)])
def test_split_k_gives_the_product(block_size, kind, m, dtype, poisoned_empty):
    """Two to four slices of K (the last one short): partials summed in split order by the last
    program of each tile, the same result on every call; the counters are left at zero."""
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    n, k = rng.randint(20, 70), rng.randint(300, 450)
    q, s = _weight(gen, n, k, block_size)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    with reports_seed(seed):
        for split in (2, 4):
            if kind == "gemv":
                config = fp8_gemv.gemv_config(m, n, k, block_k=64, block_n=8, split=split)
            else:
                config = few.Fp8MmaConfig(block_k=32, num_stages=2, split=split)
            got = few.fp8_few_rows_linear(x, q, s, block_size, bias, config)
            check_product(got, x, q, s, block_size, bias, dtype)
            assert torch.equal(got, few.fp8_few_rows_linear(x, q, s, block_size, bias, config))
            assert not few._COUNTERS.get(torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("block_size", [BLOCK, (32, 64), None], ids=["128x128", "32x64", "channel"])
@pytest.mark.parametrize("kind, m, dtype", [("gemv", 1, torch.float16), ("gemv", 2, torch.float32),
                                            ("mma", 4, torch.float16)])
def test_gated_epilogue_is_silu_and_mul_of_the_product(block_size, kind, m, dtype, poisoned_empty):
    """W = [gate; up] (2I rows, I a multiple of the block's rows as in every MLP): the kernel's
    silu(gate) * up equals silu_and_mul of its own ungated product (same sums, SiluAndMul's
    roundings), with and without split-K and a bias; fp8_linear(gated=True) on the CPU is the twin's."""
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    inter = 128 if block_size == BLOCK else 32 * rng.randint(1, 3)
    k = rng.randint(129, 300)
    q, s = _weight(gen, 2 * inter, k, block_size)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(2 * inter, generator=gen).to(dtype).to(DEVICE)
    if kind == "gemv":
        configs = [fp8_gemv.gemv_config(m, 2 * inter, k, block_n=16),
                   fp8_gemv.gemv_config(m, 2 * inter, k, block_k=64, block_n=16, split=2)]
    else:
        configs = [few.mma_config(k, block_size), few.Fp8MmaConfig(block_k=32, num_stages=2, split=3)]
    with reports_seed(seed):
        for config, b in zip(configs, (None, bias)):
            plain = few.fp8_few_rows_linear(x, q, s, block_size, b, config)  # [M, 2I]
            gated = few.fp8_few_rows_linear(x, q, s, block_size, b, config, gated=True)  # [M, I]
            assert gated.shape == (m, inter) and not torch.isnan(gated).any()
            want = silu_and_mul_torch(plain)
            torch.testing.assert_close(gated, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    xc, qc, sc = x.cpu(), q.cpu(), s.cpu()
    assert torch.equal(fp8_linear(xc, qc, sc, block_size, gated=True),
                       silu_and_mul_torch(ref.fp8_linear_torch(xc, qc, sc, block_size)))


def test_candidate_configs_all_give_the_product(poisoned_empty):
    """Every config the H200 sweep times (GEMV tiles and splits, MMA widths and splits) computes the
    product, at a small shape with 128x128 blocks (the sweep checks them again at real shapes)."""
    gen = torch.Generator().manual_seed(7)
    n, k = 64, 512
    q, s = _weight(gen, n, k, BLOCK)
    for m in (1, 4):
        x = torch.randn(m, k, generator=gen).half().to(DEVICE)
        configs = few.candidate_configs(m, n, k, torch.float16, BLOCK, DEVICE)
        assert configs[0] == few.default_config(m, n, k, torch.float16, BLOCK, DEVICE)
        assert any(isinstance(c, few.Fp8MmaConfig) for c in configs)  # at one row too (fp16 / bf16 x)
        for config in configs:
            check_product(few.fp8_few_rows_linear(x, q, s, BLOCK, None, config), x, q, s, BLOCK, None,
                          torch.float16)


def test_default_configs_follow_the_h200_sweep():
    """The defaults reproduce the H200 sweep's winners at Llama-8B's shapes (b3ec0f8) by rule: the
    MMA splits K while its programs stay within eight per multiprocessor (qkv, o, down 8 ways,
    gate_up 2), never below 512 columns a slice; the GEMV at one row reads 8 KiB tiles over four
    warps, eight rows of 1024 columns where that leaves four programs a multiprocessor, else four
    rows of 2048; shapes the sweep did not time follow the same rule. The GEMV's tiles at one row
    follow the in-graph sweep (sweep_linears_in_graph_gpu.py, 5b0b5ca), gemv_config's docstring; at one
    row of fp16 / bf16 x they are the float32 GEMV's tiles where the half GEMV does not fit."""
    cpu = torch.device("cpu")  # the interpreter's device limits: 132 multiprocessors
    assert few.mma_config(4096, BLOCK, 4096, cpu).split == 8  # o
    assert few.mma_config(14336, BLOCK, 4096, cpu).split == 8  # down
    assert few.mma_config(4096, BLOCK, 6144, cpu).split == 8  # qkv
    assert few.mma_config(4096, BLOCK, 28672, cpu).split == 2  # gate_up
    assert few.mma_config(4096, BLOCK, 28672, cpu).block_k == 128
    assert few.mma_config(1024, BLOCK, 64, cpu).split == 2  # slices of 512 at least
    assert few.mma_config(512, BLOCK, 64, cpu).split == 1
    assert few.mma_config(4096, BLOCK, 200_000, cpu).split == 1  # a vocabulary: programs enough
    gemv = fp8_gemv.Fp8GemvConfig
    for n, k, want in (((6144, 4096, gemv(1, 8, 512, 4))), (28672, 4096, gemv(1, 16, 512, 4)),
                       (4096, 4096, gemv(1, 8, 1024, 4)), (4096, 14336, gemv(1, 8, 1024, 4))):
        assert few.default_config(1, n, k, torch.float32, BLOCK, cpu) == want, (n, k)  # (half x: test_fp8_gemv_half)
    assert fp8_gemv.gemv_config(1, 6144, 100).block_k == 128  # K in one tile
    assert fp8_gemv.gemv_config(4, 6144, 4096) == gemv(4, 4, 1024, 4)  # float32 x at 4 rows
    # blocks of 4 rows: eight rows a program would straddle two, so four
    assert few.default_config(1, 8192, 256, torch.bfloat16, (4, 128), cpu).block_n == 4


def test_few_rows_bad_inputs_raise_clear_errors():
    q, s = ref.quantize_fp8_blocks(torch.randn(70, 200), BLOCK)
    x = torch.randn(2, 200).half()
    with pytest.raises(ValueError, match="1 to 16 rows"):
        few.fp8_few_rows_linear(torch.randn(17, 200).half(), q, s, BLOCK, config=few.mma_config(200, BLOCK))
    with pytest.raises(ValueError, match="1 to 4 rows"):
        few.fp8_few_rows_linear(torch.randn(5, 200), q, s, BLOCK, config=fp8_gemv.gemv_config(4, 70, 200))
    with pytest.raises(ValueError, match="x in"):
        few.fp8_few_rows_linear(x.float(), q, s, BLOCK, config=few.mma_config(200, BLOCK))
    with pytest.raises(ValueError, match="power-of-two width"):
        q96, s96 = ref.quantize_fp8_blocks(torch.randn(70, 200), (128, 96))
        few.fp8_few_rows_linear(x, q96, s96, (128, 96))
    with pytest.raises(ValueError, match="divide the quant block"):
        few.fp8_few_rows_linear(x, q, s, BLOCK, config=few.Fp8MmaConfig(block_k=256))
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[70\]"):
        few.fp8_few_rows_linear(x, q, s, BLOCK, torch.zeros(70))
    q48, s48 = ref.quantize_fp8_blocks(torch.randn(96, 200), (48, 128))
    with pytest.raises(ValueError, match="must lie in one block row"):
        few.fp8_few_rows_linear(x[:1], q48, s48, (48, 128), config=fp8_gemv.gemv_config(1, 96, 200, block_n=32))
    with pytest.raises(ValueError, match="even block_n"):
        few.fp8_few_rows_linear(x[:1], q, s, BLOCK, config=fp8_gemv.gemv_config(1, 70, 200, block_n=1), gated=True)


def test_activation_quantizer_kernel_gives_the_twins_bits(poisoned_empty):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    m, k = 9, 300  # a ragged last group
    x = torch.randn(m, k, generator=gen) * torch.exp(3 * torch.randn(m, 1, generator=gen))
    x[2] = 0.0
    x[5, :128] = 1e-30  # a tiny group: the amax floor
    with reports_seed(seed):
        for dtype in (torch.float32, torch.float16):
            xs = x.to(dtype).to(DEVICE)
            q, scales = gemm.quantize_per_token_group(xs, groups_per_program=2)  # two programs per row
            want_q, want_scales = ref.quantize_fp8_per_token_group(xs)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(scales, want_scales)


@pytest.mark.parametrize("block_size", [BLOCK, (64, 128), None], ids=["128x128", "64x128", "channel"])
def test_gemm_matches_float64_of_the_quantized_activations(block_size, poisoned_empty):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, n, k = rng.randint(17, 80), rng.randint(65, 200), rng.randint(129, 400)
    q, s = _weight(gen, n, k, block_size)
    x = (torch.randn(m, k, generator=gen) * 2).half().to(DEVICE)
    bias = torch.randn(n, generator=gen).half().to(DEVICE)
    xq, xs = ref.quantize_fp8_per_token_group(x)
    x_used = ref.dequantize_per_token_group(xq, xs)  # what the FP8 MMA multiplies
    with reports_seed(seed):
        small_tiles = gemm.Fp8GemmConfig(block_m=32, block_n=64, group_m=2, num_stages=2, num_warps=4)
        for config, b in ((small_tiles, bias), (None, None)):
            got = gemm.fp8_gemm(x, q, s, block_size, b, config)
            check_product(got, x_used, q, s, block_size, b, torch.float16)
            twin = ref.fp8_linear_quantized_activations_torch(x, q, s, block_size, b)
            check_product(twin, x_used, q, s, block_size, b, torch.float16)


def test_gemm_bad_inputs_raise_clear_errors():
    q, s = ref.quantize_fp8_blocks(torch.randn(70, 200), (128, 64))
    with pytest.raises(ValueError, match="128 columns wide"):
        gemm.fp8_gemm(torch.randn(20, 200), q, s, (128, 64))
    q, s = ref.quantize_fp8_blocks(torch.randn(70, 200), BLOCK)
    with pytest.raises(ValueError, match=r"\[M, K=200\]"):
        gemm.fp8_gemm(torch.randn(20, 201), q, s, BLOCK)
    with pytest.raises(ValueError, match="power of two"):
        gemm.quantize_per_token_group(torch.randn(2, 200), group=96)


@pytest.mark.parametrize("block_size", [BLOCK, None], ids=["128x128", "channel"])
def test_mma_rows_of_any_magnitude_keep_the_product(block_size, poisoned_empty):
    """The MMA's fp16 dot (half_x): each row of x taken times its own power of two, rows of very
    different size in one call (hundreds, hundredths, zero, one outlier) give the product, the
    same as the dot in x's dtype (half_x=False) within float32 rounding."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, k = 70, 300
    q, s = _weight(gen, n, k, block_size)
    x = torch.randn(5, k, generator=gen)
    x[0] *= 100.0
    x[1] *= 1e-2  # (outputs stay fp16 normals)
    x[2] = 0.0
    x[3, 7] = 300.0  # one outlier
    x = x.half().to(DEVICE)
    with reports_seed(seed):
        got = few.fp8_few_rows_linear(x, q, s, block_size, None, few.Fp8MmaConfig(block_k=64, num_stages=2))
        check_product(got, x, q, s, block_size, None, torch.float16)
        assert not got[2].any()
        plain = few.fp8_few_rows_linear(x, q, s, block_size, None, few.Fp8MmaConfig(64, 2, half_x=False))
        torch.testing.assert_close(got.float(), plain.float(), rtol=2 * 2**-10, atol=1e-6)
