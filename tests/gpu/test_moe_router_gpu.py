"""The fused MoE routing kernel (`select_experts_triton`) on a CUDA device against its torch twin
`select_experts` run on the same device: DeepSeek-V2-Lite / V2 (softmax greedy), Kimi-K2 (sigmoid
noaux_tc, n_group 1, 384 experts) and tiny configs, 1 to 64 tokens and one prefill-sized batch;
Router.forward's dispatch (kernel under inference, twin under autograd); no host sync in a launch;
capture and replay in a CUDA graph.

Every case draws fresh random logits; a failure prints the seed that reproduces it. Tokens whose
top k + 1 choices lie within 1e-5 (relative) of each other are redrawn: there another exp may
legitimately swap two experts. The ids must then be equal, the weights within a few roundings.
"""

from __future__ import annotations

import random

import pytest
import torch


from fixtures import routing
from fixtures.routing import CASES
from fixtures.seeds import reports_seed
from foretell.ops.moe import triton_router as mrt
from foretell.layers.moe import Router
from foretell.ops.moe.reference import RouterConfig, select_experts

DEVICE = torch.device("cuda")
NEAR = dict(rtol=3e-6, atol=1e-9)  # tl.exp is ex2.approx here: up to ~1e-6 relative per exp


def _seed() -> int:
    return random.randrange(2**31)


def draw_inputs(seed: int, num_tokens: int, config: RouterConfig, with_bias: bool, bias=None):
    """(logits [T, E], bias [E] or None) on the device, the bias drawn unless given."""
    gen = torch.Generator().manual_seed(seed)
    if bias is None and with_bias:
        bias = torch.randn(config.num_experts, generator=gen) * 0.5  # [E]
    cpu_bias = bias.cpu() if bias is not None else None
    logits = routing.draw_logits(gen, num_tokens, config, cpu_bias, DEVICE)
    return logits, (cpu_bias.to(DEVICE) if cpu_bias is not None else None)


def assert_same_routing(got, expected):
    routing.assert_same_routing(got, expected, NEAR)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 17, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_select_experts(case, num_tokens):
    config, with_bias = CASES[case]
    seed = _seed()
    logits, bias = draw_inputs(seed, num_tokens, config, with_bias)
    with reports_seed(seed):
        assert_same_routing(mrt.select_experts_triton(logits, config, bias), select_experts(logits, config, bias))


@pytest.mark.parametrize("case", ["v2_lite", "kimi_k2"])
def test_prefill_batch(case):
    config, with_bias = CASES[case]
    seed = _seed()
    logits, bias = draw_inputs(seed, 3001, config, with_bias)
    with reports_seed(seed):
        assert_same_routing(mrt.select_experts_triton(logits, config, bias), select_experts(logits, config, bias))


def test_router_dispatch_inference_and_autograd(monkeypatch):
    calls = []
    kernel = mrt.route_triton  # 5 tokens: logits and selection in one launch
    monkeypatch.setattr(mrt, "route_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    config, _ = CASES["kimi_k2"]
    router = Router(config, 64, device=DEVICE)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.125)
        router.e_score_correction_bias.normal_(0.0, 0.1)
    hidden = torch.randn(5, 64, device=DEVICE, dtype=torch.bfloat16)  # [T, H]
    with torch.no_grad():
        router(hidden)
    assert calls == [1]
    router(hidden.float().requires_grad_())  # autograd: the twin runs
    assert calls == [1]
    grouped = Router(RouterConfig(256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5), 64, device=DEVICE)
    with torch.no_grad():
        grouped.weight.normal_(0.0, 0.125)
        grouped.e_score_correction_bias.zero_()
        grouped(hidden)
    assert calls == [1]


@pytest.mark.parametrize("case", ["v2_lite", "kimi_k2", "tiny"])
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_one_launch_route_equals_logits_then_select(case, num_tokens):
    """route_triton: the last of the logits programs selects; bit-equal to the two launches, the
    counter back at zero, repeated launches and a graph replay included."""
    config, with_bias = CASES[case]
    router = Router(config, 2048, device=DEVICE)
    with torch.no_grad():
        router.weight.normal_(0.0, 2048**-0.5)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(0.0, 0.1)
    bias = router.e_score_correction_bias if with_bias else None
    hidden = torch.randn(num_tokens, 2048, device=DEVICE, dtype=torch.bfloat16)  # [T, H]
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def both():
        got = mrt.route_triton(hidden, router.weight, config, bias, counter)
        return got, mrt.select_experts_triton(mrt.router_logits_triton(hidden, router.weight), config, bias)

    for _ in range(20):
        (weights, ids), (want_w, want_ids) = both()
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (weights, ids), (want_w, want_ids) = both()
    for _ in range(3):
        hidden.copy_(torch.randn_like(hidden))
        graph.replay()
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    assert counter.item() == 0


def test_no_sync_and_graph_replay():
    config, with_bias = CASES["kimi_k2"]
    seed = _seed()
    logits, bias = draw_inputs(seed, 16, config, with_bias)
    mrt.select_experts_triton(logits, config, bias)  # compile
    mrt.select_experts_triton(logits[:1], config, bias)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mrt.select_experts_triton(logits, config, bias)
        mrt.select_experts_triton(logits[:1], config, bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = logits.clone()  # [16, E]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_weights, static_ids = mrt.select_experts_triton(static, config, bias)
    for replay in range(3):
        new_logits, _ = draw_inputs(seed + 1 + replay, 16, config, with_bias, bias)
        static.copy_(new_logits)
        graph.replay()
        with reports_seed(seed + 1 + replay):
            assert_same_routing((static_weights, static_ids), select_experts(new_logits, config, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,num_experts,hidden", [(1, 64, 2048), (4, 64, 2048), (16, 384, 7168)])
def test_router_logits_match_float64(dtype, num_tokens, num_experts, hidden):
    """The router-logits kernel at V2-Lite and Kimi-K2 sizes, against float64: within float32
    accumulation over the hidden size; captured in a CUDA graph it gives the same values."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(DEVICE)
    expected = x.double() @ weight.double().T
    bound = 4 * hidden * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    got = mrt.router_logits_triton(x, weight)
    with reports_seed(seed):
        assert ((got.double() - expected).abs() <= bound).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = mrt.router_logits_triton(x, weight)
    graph.replay()
    assert torch.equal(static, got)
