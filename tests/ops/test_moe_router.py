"""The fused MoE routing kernel (`select_experts_triton`) held against its torch twin
`select_experts`, in Triton's interpreter on CPU tensors (the real kernel on a CUDA machine), at
DeepSeek-V2-Lite (softmax greedy), Kimi-K2-like (sigmoid noaux_tc with a correction bias, n_group 1,
a non-power-of-two expert count) and tiny sizes; Router.forward's dispatch to it.

Every case draws fresh random logits; a failure prints the seed that reproduces it. Buffers the
wrapper allocates start poisoned (NaN weights, out-of-range ids), so an element the kernel does
not write shows. The kernel's exp is not torch's, so two experts whose choices lie within a
rounding of each other may legitimately swap places; tokens with such near-ties among the top
k + 1 choices are redrawn, and the ids must then be equal.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures import routing
from fixtures.routing import CASES
from fixtures.seeds import reports_seed
from foretell.layers.moe import Router
from foretell.ops.moe import dispatch as moe_dispatch
from foretell.ops.moe.reference import RouterConfig, select_experts

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
mrt = import_interpreted("foretell.ops.moe.triton_router")

NEAR = dict(rtol=1e-6, atol=1e-9)  # a few float32 roundings (exp, the sums' order)
CPU_CASES = ["v2_lite", "kimi_k2_like", "v2_softmax_norm", "tiny", "tiny_top1_bias"]


def _seed() -> int:
    return random.randrange(2**31)


def draw_logits(gen, num_tokens, config, bias) -> torch.Tensor:  # [num_tokens, E] float32
    return routing.draw_logits(gen, num_tokens, config, bias, DEVICE)


def assert_same_routing(got, expected):
    routing.assert_same_routing(got, expected, NEAR)


def poison_buffers(monkeypatch):
    """torch.empty gives NaN (floats) or out-of-range ids (ints): an unwritten element shows."""
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("case", CPU_CASES)
def test_matches_select_experts(case, num_tokens, monkeypatch):
    config, with_bias = CASES[case]
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(config.num_experts, generator=gen) * 0.5 if with_bias else None  # [E]
    logits = draw_logits(gen, num_tokens, config, bias)  # [T, E]
    bias = bias.to(DEVICE) if bias is not None else None
    expected = select_experts(logits, config, bias)
    poison_buffers(monkeypatch)
    with reports_seed(seed):
        assert_same_routing(mrt.select_experts_triton(logits, config, bias), expected)


def test_strided_logits():
    """Logits a column slice of a wider tensor (rows further apart than num_experts)."""
    config, _ = CASES["v2_lite"]
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(5, 80, generator=gen).to(DEVICE)  # [T, 80]
    wide[:, 16:] = draw_logits(gen, 5, config, None)
    logits = wide[:, 16:]  # [T, 64], stride 80
    with reports_seed(seed):
        assert_same_routing(mrt.select_experts_triton(logits, config), select_experts(logits, config))


def test_exact_ties_go_to_the_lower_expert():
    config = RouterConfig(8, 3, "softmax", "greedy", norm_topk_prob=True)
    weights, ids = mrt.select_experts_triton(torch.zeros(2, 8, device=DEVICE), config)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3, device=DEVICE))


def test_no_tokens():
    config, _ = CASES["kimi_k2_like"]
    weights, ids = mrt.select_experts_triton(torch.zeros(0, 96, device=DEVICE), config, torch.zeros(96, device=DEVICE))
    assert weights.shape == ids.shape == (0, 8 + 3)  # top 8, then 3 shared experts


def test_bad_inputs():
    grouped = RouterConfig(16, 4, "sigmoid", "noaux_tc", 4, 2, True, 2.5)
    with pytest.raises(ValueError, match="ungrouped.*n_group=4"):
        mrt.select_experts_triton(torch.zeros(2, 16, device=DEVICE), grouped, torch.zeros(16, device=DEVICE))
    config = RouterConfig(16, 4)
    with pytest.raises(ValueError, match="router_logits must be"):
        mrt.select_experts_triton(torch.zeros(16, device=DEVICE), config)
    with pytest.raises(ValueError, match="router_logits must be"):
        mrt.select_experts_triton(torch.zeros(2, 12, device=DEVICE), config)
    with pytest.raises(ValueError, match="float32"):
        mrt.select_experts_triton(torch.zeros(2, 16, dtype=torch.float16, device=DEVICE), config)
    with pytest.raises(ValueError, match="correction_bias"):
        mrt.select_experts_triton(torch.zeros(2, 16, device=DEVICE), config, torch.zeros(8, device=DEVICE))


def _router(config: RouterConfig, hidden: int, gen: torch.Generator) -> Router:
    router = Router(config, hidden, device=DEVICE)
    with torch.no_grad():
        router.weight.copy_(torch.randn(config.num_experts, hidden, generator=gen) / hidden**0.5)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.copy_(torch.randn(config.num_experts, generator=gen) * 0.1)
    return router


def _count_kernel_calls(monkeypatch, name: str = "select_experts_triton") -> list:
    calls = []
    kernel = getattr(mrt, name)
    monkeypatch.setattr(mrt, name, lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    return calls


@pytest.mark.parametrize("num_tokens, kernel", [(4, "route_triton"), (17, "select_experts_triton")])
def test_router_dispatches_ungrouped_configs_to_the_kernel(monkeypatch, num_tokens, kernel):
    """With use_triton forced on, Router.forward's result is the kernel's, equal to the twin's: one
    launch for logits and selection up to ROUTER_LOGITS_MAX_TOKENS tokens, the selection kernel
    after cuBLAS's logits beyond."""
    monkeypatch.setattr(moe_dispatch, "use_triton", lambda *tensors: True)
    calls = _count_kernel_calls(monkeypatch, kernel)
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    config, _ = CASES["kimi_k2_like"]
    router = _router(config, config.num_experts, gen)
    with torch.no_grad():
        router.weight.copy_(torch.eye(config.num_experts))  # logits = hidden, exactly
    bias = router.e_score_correction_bias
    hidden = draw_logits(gen, num_tokens, config, bias.cpu())  # [T, E]
    with torch.no_grad(), reports_seed(seed):
        got = router(hidden)
        assert calls == [1]
        assert_same_routing(got, select_experts(hidden, config, bias))
        assert router.route_counter.item() == 0


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_route_equals_logits_then_select(case, num_tokens):
    """route_triton is router_logits_triton + select_experts_triton in one launch: the same
    arithmetic, so the same bits; its counter is back at zero after every launch."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    config, with_bias = CASES[case]
    router = _router(config, 40, gen)
    bias = router.e_score_correction_bias if with_bias else None
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with torch.no_grad(), reports_seed(seed):
        for _ in range(2):
            hidden = torch.randn(num_tokens, 40, generator=gen).half().to(DEVICE)  # [T, H]
            weights, ids = mrt.route_triton(hidden, router.weight, config, bias, counter)
            expected = mrt.select_experts_triton(mrt.router_logits_triton(hidden, router.weight), config, bias)
            assert torch.equal(ids, expected[1]) and torch.equal(weights, expected[0])
            assert counter.item() == 0


def test_route_refuses_bad_input():
    config, _ = CASES["tiny"]
    weight = torch.zeros(config.num_experts, 32, device=DEVICE)
    hidden = torch.zeros(2, 32, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        mrt.route_triton(hidden, weight, config, None, counter.float())
    with pytest.raises(ValueError, match="experts but the config"):
        mrt.route_triton(hidden, weight[:-1], config, None, counter)
    with pytest.raises(ValueError, match="up to"):
        mrt.route_triton(torch.zeros(17, 32, device=DEVICE), weight, config, None, counter)


def test_router_keeps_grouped_configs_on_torch(monkeypatch):
    monkeypatch.setattr(moe_dispatch, "use_triton", lambda *tensors: True)
    calls = _count_kernel_calls(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    router = _router(RouterConfig(16, 4, "sigmoid", "noaux_tc", 4, 2, True, 2.5), 32, gen)
    hidden = torch.randn(3, 32, generator=gen).to(DEVICE)  # [T, H]
    with torch.no_grad():
        weights, ids = router(hidden)
        # The logits come from the logits kernel (3 tokens), the selection from the twin.
        expected = select_experts(mrt.router_logits_triton(hidden, router.weight), router.config,
                                  router.e_score_correction_bias)
    assert calls == []
    assert torch.equal(ids, expected[1]) and torch.equal(weights, expected[0])


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU path")
def test_router_stays_on_torch_off_cuda(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _router(CASES["tiny"][0], 32, gen)(torch.randn(3, 32, generator=gen))
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,hidden", [(1, 64, 2048), (3, 96, 100), (16, 8, 48)])
def test_router_logits_match_float64(dtype, num_tokens, num_experts, hidden, monkeypatch):
    """router_logits_triton = hidden (widened to float32) x weight^T: against float64, bounded by
    float32 accumulation over `hidden` terms; a column slice of a wider tensor as input."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, hidden + 5, generator=gen).to(dtype)
    x = wide[:, 5:]  # [T, H], rows hidden + 5 apart
    weight = torch.randn(num_experts, hidden, generator=gen) / hidden**0.5  # [E, H] float32
    expected = x.double() @ weight.double().T  # [T, E]
    poison_buffers(monkeypatch)
    with reports_seed(seed):
        got = mrt.router_logits_triton(x.to(DEVICE), weight.to(DEVICE))
        assert got.dtype == torch.float32 and got.shape == (num_tokens, num_experts)
        bound = 4 * hidden * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
        assert ((got.cpu().double() - expected).abs() <= bound + 1e-30).all()


def test_router_logits_bad_inputs():
    x = torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be a contiguous float32"):
        mrt.router_logits_triton(x, torch.zeros(8, 32, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"hidden must be \[num_tokens, H\]"):
        mrt.router_logits_triton(x, torch.zeros(8, 31, device=DEVICE))
    with pytest.raises(ValueError, match="up to 16 tokens"):
        mrt.router_logits_triton(torch.zeros(17, 32, device=DEVICE), torch.zeros(8, 32, device=DEVICE))
