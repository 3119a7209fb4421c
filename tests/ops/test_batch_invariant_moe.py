"""The batch-invariant MoE (ops/moe/batch_invariant.py, issue 23) and the row-local ops the mode relies
on as they are: a token's routing and expert sum computed alone equal the same token's among 2..64
tokens, bit for bit, and agree with the reference (experts_forward_torch) within rounding; RMSNorm,
RoPE and SiLU-and-mul (torch paths: what the CPU runs) are row-local already.
"""

from __future__ import annotations

import pytest
import torch

from foretell.layers.norm import rms_norm_torch
from foretell.ops.moe.batch_invariant import experts_forward_batch_invariant, route_batch_invariant
from foretell.ops.moe.dispatch import fused_experts, route
from foretell.ops.moe.reference import RouterConfig, experts_forward_torch
from foretell.ops.pointwise.batch_invariant import silu_and_mul_batch_invariant
from foretell.ops.pointwise.reference import apply_rope_gptj, apply_rope_neox, silu_and_mul_torch

M_VALUES = [2, 3, 8, 17, 64]


def assert_rows_invariant(fn, x):
    alone = [fn(x[r : r + 1].clone()) for r in range(x.shape[0])]
    for m in M_VALUES:
        together = fn(x[:m])
        for r in range(m):
            assert torch.equal(together[r : r + 1], alone[r]), f"row {r} differs among {m}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_rows_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(0)
    hidden, inter, experts, top_k = 192, 96, 8, 2
    config = RouterConfig(num_experts=experts, top_k=top_k, scoring_func="sigmoid", topk_method="noaux_tc",
                          n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                          num_shared_experts=1)
    router = torch.randn(experts, hidden, generator=gen) / hidden**0.5  # float32, as checkpoints hold it
    bias = torch.randn(experts, generator=gen) * 0.01
    gate_up = (torch.randn(experts + 1, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts + 1, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    x = torch.randn(64, hidden, generator=gen).to(dtype)
    shared = torch.randn(64, hidden, generator=gen).to(dtype)

    def layer(rows):
        weights, ids = route(rows, router, config, bias, torch.zeros(1, dtype=torch.int32), batch_invariant=True)
        first = int((x[:, :1] == rows[:1, :1]).nonzero()[0, 0]) if rows.shape[0] == 1 else 0
        extra = shared[first : first + rows.shape[0]]
        return fused_experts(rows, gate_up, down, weights, ids, extra, batch_invariant=True)

    assert_rows_invariant(layer, x)
    weights, ids = route_batch_invariant(x, router, config, bias)
    got = experts_forward_batch_invariant(x, gate_up, down, weights, ids).float()
    want = experts_forward_torch(x.double(), gate_up.double(), down.double(), weights, ids).double()
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)


def test_moe_refuses_mismatched_weights():
    with pytest.raises(ValueError, match="one shape"):
        experts_forward_batch_invariant(torch.zeros(2, 4), torch.zeros(1, 4, 4), torch.zeros(1, 4, 2),
                                        torch.zeros(2, 1), torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_rope_and_activation_are_row_local(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4096, generator=gen).to(dtype)
    weight = torch.randn(4096, generator=gen).to(dtype)
    assert_rows_invariant(lambda rows: rms_norm_torch(rows, weight, 1e-6), x)
    assert_rows_invariant(silu_and_mul_torch, x)
    heads = x.view(64, 32, 128)
    angles = torch.rand(64, 64, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    for apply in (apply_rope_neox, apply_rope_gptj):
        alone = [apply(heads[r : r + 1].clone(), cos[r : r + 1], sin[r : r + 1]) for r in range(64)]
        assert torch.equal(apply(heads, cos, sin), torch.cat(alone))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mode_activation_rows_on_awkward_widths(dtype):
    """Widths that leave vector tails, and enough rows to split over threads: the mode's float64
    sigmoid gives every row its own bits; within rounding of silu_and_mul_torch."""
    gen = torch.Generator().manual_seed(2)
    for width in (2 * 97, 2 * 13, 2 * 768):
        x = (torch.randn(64, width, generator=gen) * 4).to(dtype)
        assert_rows_invariant(silu_and_mul_batch_invariant, x)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(silu_and_mul_batch_invariant(x).float(), silu_and_mul_torch(x).float(), atol=tol, rtol=tol)
