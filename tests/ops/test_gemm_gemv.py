"""The GEMV (ops/gemm/triton_gemv.py) against a float64 torch reference, and the dispatch that picks
it or cuBLAS (ops/gemm/dispatch.py) with a fake timer.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors (fp16 and fp32: the
interpreter keeps bf16 as uint16; bf16 is checked on CUDA in tests/gpu/test_gemm_gemv_gpu.py).
Every torch.empty of a launch (the output) is poisoned with NaN, so a kernel that skips an
element shows it. Every case draws fresh shapes and inputs; a failure prints the
seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fixtures.float64_linear import check_gated, check_linear, poisoned_empty  # noqa: F401 (a fixture)
from fixtures.seeds import reports_seed  # noqa: E402
from foretell.config import ModelConfig
from foretell.ops.common import kernel_choice
from foretell.layers.activation import SiluAndMul
from foretell.layers.embedding import LMHead
from foretell.layers.linear import Linear, MergedLinear, QKVLinear
from foretell.layers.small_m import prepare_small_m_linears
from foretell.ops.gemm.dispatch import GemmKey, SmallMGemm, m_bucket

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
sm = import_interpreted("foretell.ops.gemm.triton_gemv")
mma = import_interpreted("foretell.ops.gemm.triton_mma")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_matches_float64_reference(dtype, m, poisoned_empty):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, k = rng.randint(17, 90), rng.randint(1025, 1700)  # not multiples of the tiles
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    with reports_seed(seed):
        # default tiles (one tile of all K), several tiles of K, more rows of W per program
        for config in (None, sm.pick_config(m, n, k, block_k=256), sm.pick_config(m, n, k, block_n=4, block_k=512)):
            for b in (bias, None):
                check_linear(sm.small_m_linear(x, weight, b, config), x, weight, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gated_output_is_the_activation_of_the_product(dtype, poisoned_empty):
    """gated=True: W is [gate; up] (2I rows); each program pairs gate row j with up row I + j and
    writes silu(gate) * up [M, I], bias included. float32_out: the plain product's values in float32."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m, inter, k = rng.randint(1, 4), rng.randint(5, 40), rng.randint(300, 700)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(2 * inter, k, generator=gen) * 3 / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(2 * inter, generator=gen).to(dtype).to(DEVICE)
    with reports_seed(seed):
        for config in (None, sm.pick_config(m, 2 * inter, k, block_n=4, block_k=128)):
            for b in (bias, None):
                product = sm.small_m_linear(x, weight, b, config)
                check_linear(product, x, weight, b)
                check_gated(sm.small_m_linear(x, weight, b, config, gated=True), product)
                # float32_out: the same rounded values, stored as float32 (LMHead's logits)
                assert torch.equal(sm.small_m_linear(x, weight, b, config, float32_out=True), product.float())


def test_strided_rows_and_tiny_k(poisoned_empty):
    x = torch.randn(3, 40, dtype=torch.float32, device=DEVICE)[:, 5:12]  # row stride 40, K = 7
    weight = torch.randn(5, 7, device=DEVICE)
    check_linear(sm.small_m_linear(x, weight), x, weight, None)


def test_configs_fit_the_rows_and_keep_threads_busy():
    rng = random.Random(0)
    for _ in range(300):
        m, n, k = rng.randint(1, 4), rng.randint(1, 50000), rng.randint(1, 20000)
        config = sm.pick_config(m, n, k)
        assert config.block_m >= m and config.block_k <= sm.MAX_BLOCK_K and 1 <= config.num_warps <= 8
        assert config.block_n * config.block_k <= 64 * 32 * config.num_warps  # up to 64 weights a thread
    assert sm.pick_config(1, 6144, 4096) == sm.SmallMConfig(1, 2, 4096, 8)  # Llama-8B qkv: one tile per program
    assert sm.pick_config(1, 4096, 14336) == sm.SmallMConfig(1, 4, 2048, 4)  # down: 4 rows, tiles of 2048


def test_bad_inputs_raise_clear_errors():
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"K=8\], got \[2, 9\]"):
        sm.small_m_linear(torch.zeros(2, 9), w)
    with pytest.raises(ValueError, match="contiguous"):
        sm.small_m_linear(x, torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="dtype"):
        sm.small_m_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="dtype"):
        sm.small_m_linear(x, w.half())
    with pytest.raises(ValueError, match="bias"):
        sm.small_m_linear(x, w, torch.zeros(3))
    with pytest.raises(ValueError, match="1 to 4 rows"):
        sm.small_m_linear(torch.zeros(5, 8), w)
    with pytest.raises(ValueError, match="even number of rows"):  # gated wants [gate; up]
        sm.small_m_linear(x, torch.zeros(5, 8), gated=True)
    with pytest.raises(ValueError, match="even block_n"):
        sm.small_m_linear(x, w, None, sm.SmallMConfig(2, 1, 8, 1), gated=True)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        sm.small_m_linear(torch.zeros(8), w)


# ---------------------------------------------------------------------- dispatch


class FakeKernels:
    """Stands in for small_m_gemm: two candidate configs, F.linear's result (or garbage)."""

    def __init__(self, wrong: bool = False):
        self.wrong, self.last, self.runs = wrong, None, 0

    def candidate_configs(self, m, n, k, dtype, device):
        return ["split1", "splitK"]

    def default_config(self, m, n, k, dtype, device):
        return "split1"

    def small_m_linear(self, x, weight, bias, config, gated=False, float32_out=False):
        self.last, self.runs = config, self.runs + 1
        y = F.linear(x, weight, bias)
        y = SiluAndMul()(y) if gated else y
        y = y.float() if float32_out else y
        return y + 1 if self.wrong else y


class FakeTimer:
    """Returns scripted seconds per candidate ("cublas" or a config name)."""

    def __init__(self, kernels: FakeKernels, times: dict[str, float]):
        self.kernels, self.times, self.timed = kernels, times, []

    def __call__(self, fn, device):
        self.kernels.last = None
        fn()
        name = self.kernels.last or "cublas"
        self.timed.append(name)
        return self.times[name]


def _gemm(times, mode="auto", capturing=False, wrong=False, max_m=4):
    kernels = FakeKernels(wrong)
    timer = FakeTimer(kernels, times)
    gemm = SmallMGemm(mode, max_m, kernels=kernels, timer=timer, is_capturing=lambda: capturing)
    return gemm, kernels, timer


W, B = torch.randn(24, 32), torch.randn(24)
KEY = GemmKey(4, 24, 32, torch.float32, True)


@pytest.mark.parametrize(
    "times, expected",
    [
        ({"cublas": 10.0, "split1": 8.0, "splitK": 6.0}, "splitK"),
        ({"cublas": 10.0, "split1": 8.0, "splitK": 9.0}, "split1"),
        ({"cublas": 10.0, "split1": 12.0, "splitK": 11.0}, None),
        ({"cublas": 10.0, "split1": 9.9, "splitK": 9.8}, None),  # within the margin: cuBLAS
    ],
)
def test_auto_keeps_the_faster_and_times_each_key_once(times, expected):
    gemm, _, timer = _gemm(times)
    assert gemm.choose(KEY, W, B) == expected
    assert sorted(timer.timed) == ["cublas", "split1", "splitK"]
    assert gemm.choose(KEY, W, B) == expected and len(timer.timed) == 3  # cached
    assert set(gemm.timings[KEY]) == {"cublas", "split1", "splitK"}
    assert "M<=4 N=24 K=32" in gemm.summary()


def test_a_kernel_that_disagrees_is_never_used():
    gemm, _, timer = _gemm({"cublas": 10.0, "split1": 1.0, "splitK": 1.0}, wrong=True)
    assert gemm.choose(KEY, W, B) is None
    assert timer.timed == ["cublas"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_agreement_check_takes_rounding_not_errors(dtype):
    from foretell.ops.gemm.dispatch import _agree

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4096, generator=gen).to(dtype)
    w = (torch.randn(300, 4096, generator=gen) / 64).to(dtype)
    expected = F.linear(x.float(), w.float()).to(dtype)
    other_order = (x.float()[:, None, :] * w.float()[None]).sum(-1).to(dtype)  # [4, 300]
    assert _agree(other_order, expected, x, w)
    broken = other_order.clone()
    broken[:, 7] = 0
    assert not _agree(broken, expected, x, w)


def test_a_kernel_that_fails_to_compile_loses_to_cublas():
    gemm, kernels, timer = _gemm({"cublas": 10.0, "split1": 1.0, "splitK": 1.0})

    def broken(x, weight, bias, config, **options):
        raise RuntimeError("triton compile error")

    kernels.small_m_linear = broken
    assert gemm.choose(KEY, W, B) is None and timer.timed == ["cublas"]


def test_capture_uses_the_cached_choice_or_cublas():
    gemm, kernels, timer = _gemm({"cublas": 10.0, "split1": 5.0, "splitK": 6.0}, capturing=True)
    assert gemm.choose(KEY, W, B) is None  # undecided during capture: cuBLAS, nothing timed
    assert timer.timed == [] and KEY not in gemm.choices
    gemm.is_capturing = lambda: False
    assert gemm.choose(KEY, W, B) == "split1"
    gemm.is_capturing = lambda: True
    assert gemm.choose(KEY, W, B) == "split1" and len(timer.timed) == 3


def test_mode_on_always_takes_the_kernel_untimed():
    gemm, _, timer = _gemm({}, mode="on")
    assert gemm.choose(KEY, W, B) == "split1" and timer.timed == []  # the default tiles
    with pytest.raises(ValueError, match="mode"):
        SmallMGemm("off")


def test_call_routes_rows_through_the_chosen_path(monkeypatch):
    gemm, kernels, _ = _gemm({"cublas": 10.0, "split1": 5.0, "splitK": 6.0})
    x = torch.randn(1, 3, 32)  # 3 rows -> bucket 4
    assert torch.equal(gemm(x, W, B), F.linear(x, W, B)) and kernels.runs == 0  # CPU: F.linear
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    torch.testing.assert_close(gemm(x, W, B), F.linear(x, W, B))
    assert kernels.last == "split1" and GemmKey(4, 24, 32, torch.float32, True) in gemm.choices
    runs = kernels.runs
    for too_many in (torch.randn(5, 32), torch.randn(3, 32).double()):  # rows, dtype: F.linear
        gemm(too_many, W.to(too_many.dtype), B.to(too_many.dtype))
    assert kernels.runs == runs
    x = torch.randn(3, 32)  # gated (a decided key): W as [gate; up], the activation of the product
    torch.testing.assert_close(gemm(x, W, B, gated=True), SiluAndMul()(F.linear(x, W, B)))
    assert kernels.runs == runs + 1 and kernels.last == "split1"
    logits = gemm(x, W, B, float32_out=True)  # float32_out: the kernel's float32 store
    assert logits.dtype == torch.float32 and kernels.runs == runs + 2
    wide = torch.randn(5, 32)  # too many rows: F.linear, then the activation
    torch.testing.assert_close(gemm(wide, W, B, gated=True), SiluAndMul()(F.linear(wide, W, B)))
    assert gemm(wide.half(), W.half(), B.half(), float32_out=True).dtype == torch.float32
    assert kernels.runs == runs + 2
    assert [m_bucket(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]


def test_layers_run_the_interpreted_kernel_when_bound(monkeypatch):
    """Linear, its fused subclasses and LMHead, bound in mode "on": the GEMV's result for one row
    (a batch-1 decode step), the MMA's for 2 to 4 rows (fp16), F.linear's for more."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    dtype = torch.float16
    layers = [Linear(40, 24, bias=True, dtype=dtype, device=DEVICE), MergedLinear(40, [8, 12], dtype=dtype, device=DEVICE),
              QKVLinear(40, 8, 2, 1, dtype=dtype, device=DEVICE), LMHead(50, 40, dtype=dtype, device=DEVICE)]
    for layer in layers:
        for p in layer.parameters():
            p.data.normal_()
    x = torch.randn(1, 40).to(dtype).to(DEVICE)
    plain = [layer(x) for layer in layers]
    gemm = prepare_small_m_linears(torch.nn.ModuleList(layers), max_m=4, mode="on")
    assert all(layer.small_m is gemm for layer in layers) and gemm.max_m == 4
    calls, mma_calls = [], []
    kernel, mma_kernel = sm.small_m_linear, mma.small_m_mma_linear
    monkeypatch.setattr(sm, "small_m_linear", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(mma, "small_m_mma_linear", lambda *a, **kw: mma_calls.append(1) or mma_kernel(*a, **kw))
    for layer, expected in zip(layers, plain):
        got = layer(x)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert len(calls) == len(layers)
    three_rows = torch.randn(3, 40).to(dtype).to(DEVICE)
    torch.testing.assert_close(layers[1](three_rows), F.linear(three_rows, layers[1].weight), rtol=2e-3, atol=2e-3)
    assert len(calls) == len(layers) and len(mma_calls) == 1  # the tensor-core path
    five_rows = torch.randn(5, 40).to(dtype).to(DEVICE)
    assert torch.equal(layers[1](five_rows), F.linear(five_rows, layers[1].weight))  # past max_m: cuBLAS
    assert len(mma_calls) == 1


def test_kernel_defaults_by_rows_dtype_and_k():
    """ops/gemm/triton_kernels.default_config (mode "on"): the GEMV for one row, the MMA for 2-16 rows in
    fp16 / bf16 (split-K for a long K), cuBLAS (None) for several float32 rows; mode "auto" times the GEMV's configs up to 4 rows and the MMA's in fp16 / bf16."""
    kernels = import_interpreted("foretell.ops.gemm.triton_kernels")
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        assert isinstance(kernels.default_config(1, 4096, 4096, dtype, cpu), sm.SmallMConfig)
    for m in (2, 4, 16):
        assert isinstance(kernels.default_config(m, 6144, 4096, torch.float16, cpu), mma.MmaConfig)
        assert kernels.default_config(m, 6144, 4096, torch.float32, cpu) is None
    assert kernels.default_config(1, 4096, 14336, torch.bfloat16, cpu) == sm.SmallMConfig(1, 4, 2048, 4)  # down
    assert kernels.default_config(4, 4096, 14336, torch.bfloat16, cpu).split == 4  # down, verify: split-K MMA
    assert kernels.default_config(17, 4096, 4096, torch.bfloat16, cpu) is None
    kinds = [type(c) for c in kernels.candidate_configs(4, 4096, 4096, torch.float16, cpu)]
    assert sm.SmallMConfig in kinds and mma.MmaConfig in kinds
    assert all(isinstance(c, sm.SmallMConfig) for c in kernels.candidate_configs(4, 4096, 4096, torch.float32, cpu))
    assert all(isinstance(c, mma.MmaConfig) for c in kernels.candidate_configs(16, 4096, 4096, torch.float16, cpu))
    gemm = SmallMGemm("on", 16, kernels=kernels)
    assert gemm.choose(GemmKey(4, 24, 32, torch.float32, False), W, None) is None


def test_prepare_warms_every_bucket_and_binds_once(monkeypatch):
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    head = LMHead(50, 32)
    model = torch.nn.ModuleList([Linear(32, 24, bias=True), Linear(32, 24, bias=True), head])
    for p in model.parameters():
        p.data.normal_()
    gemm, _, timer = _gemm({"cublas": 10.0, "split1": 5.0, "splitK": 6.0}, max_m=3)
    assert prepare_small_m_linears([model, head], max_m=3, gemm=gemm) is gemm
    assert gemm.max_m == 4
    assert set(gemm.choices) == {GemmKey(m, n, 32, torch.float32, bias) for m in (1, 2, 4)
                                 for n, bias in ((24, True), (50, False))}
    assert len(timer.timed) == 6 * 3  # each key timed once: cuBLAS + two configs


def test_off_and_cpu_bind_nothing():
    layer = Linear(8, 4)
    assert prepare_small_m_linears(layer, 4, "auto") is None and layer.small_m is None  # CPU
    assert prepare_small_m_linears(layer, 4, "off") is None
    with pytest.raises(ValueError, match="small_m_gemm"):
        prepare_small_m_linears(layer, 4, "fast")
    with pytest.raises(ValueError, match="small_m_gemm"):
        ModelConfig(model="x", small_m_gemm="fast")


def test_cli_flag_reaches_the_model_config(tmp_path):
    import argparse

    from foretell.cli_args import add_engine_args, engine_kwargs_from_args
    from foretell.config import build_engine_config

    model = str(tmp_path)  # an existing folder: the config resolves it without the Hub
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs_from_args(parser.parse_args(["--model", model, "--small-m-gemm", "auto"]))
    assert build_engine_config(model, **kwargs).model.small_m_gemm == "auto"
    kwargs = engine_kwargs_from_args(parser.parse_args(["--model", model]))
    assert build_engine_config(model, **kwargs).model.small_m_gemm == "on"


def test_gated_projection_runs_the_activation_in_the_kernel(monkeypatch):
    """MergedLinear.forward_gated (an MLP's gate_up): silu_and_mul(F.linear(x)), from the GEMV's
    epilogue for one row, the MMA's for three (fp16), torch's unbound; two unequal parts refuse."""
    monkeypatch.setattr(kernel_choice, "use_triton", lambda *tensors: True)
    dtype = torch.float16
    gate_up = MergedLinear(40, [12, 12], bias=True, dtype=dtype, device=DEVICE)
    for p in gate_up.parameters():
        p.data.normal_()
    rows = [torch.randn(m, 40).to(dtype).to(DEVICE) for m in (1, 3)]
    unbound = [gate_up.forward_gated(x) for x in rows]
    for x, got in zip(rows, unbound):
        expected = SiluAndMul()(F.linear(x.cpu().float(), gate_up.weight.cpu().float(), gate_up.bias.cpu().float()))
        torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-3, atol=2e-3)
    prepare_small_m_linears(gate_up, max_m=4, mode="on")
    launches = []
    for module, name in ((sm, "small_m_linear"), (mma, "small_m_mma_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, **kw: launches.append(kw) or kernel(*a, **kw))
    for x, expected in zip(rows, unbound):
        got = gate_up.forward_gated(x)
        assert got.shape == (x.shape[0], 12)
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert [kw.get("gated") for kw in launches] == [True, True]
    with pytest.raises(ValueError, match="two equal parts"):
        MergedLinear(40, [8, 12], dtype=dtype, device=DEVICE).forward_gated(rows[0])
