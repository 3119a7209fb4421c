"""The batch-invariant MoE (ops/moe/batch_invariant.py, issue 23) and the row-local ops the mode relies
on as they are: a token's routing and expert sum computed alone equal the same token's among 2..64
tokens, bit for bit, and agree with the reference (experts_forward_torch) within rounding; RMSNorm,
RoPE and SiLU-and-mul (torch paths: what the CPU runs) are row-local already.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.order_fixed_dot import order_fixed_dot  # noqa: F401  (a fixture: tl.dot summed in K order)
from fixtures.triton_interpreter import interpreter_mode  # noqa: F401
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


# ------------------------------------------------------------------------------------ Triton


def _expert_world(dtype, num_tokens=40, hidden=48, inter=40, experts=6, top_k=3, seed=11, device="cpu"):
    """Routed tokens with expert ids in every order (ties of one expert within a token too: a
    shared expert appended as a slot), float32 weights, a shared-experts output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[: top_k - 1] for _ in range(num_tokens)])
    ids = torch.cat([ids, torch.full((num_tokens, 1), experts - 1)], dim=1)  # [T, top_k] int64
    weights = torch.rand(num_tokens, top_k, generator=gen)  # float32
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    return [t.to(device) for t in (x, gate_up, down, weights, ids, shared)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter's bf16 dot is broken
def test_triton_experts_rows_do_not_depend_on_the_batch(order_fixed_dot, dtype):
    """The mode's Triton experts (batch_invariant_triton.py): a token alone, among 2..40 tokens, in
    another order, and with either align step gives the same bits; close to float64."""
    from fixtures.triton_interpreter import HAS_CUDA, import_interpreted

    kernels = import_interpreted("foretell.ops.moe.batch_invariant_triton")
    device = "cuda" if HAS_CUDA else "cpu"
    x, gate_up, down, weights, ids, shared = _expert_world(dtype, device=device)

    def run(rows, align_kernel=None):  # token indices -> [len(rows), hidden]
        return kernels.experts_forward_batch_invariant_triton(
            x[rows].clone(), gate_up, down, weights[rows].clone(), ids[rows].clone(), shared[rows].clone(),
            align_kernel=align_kernel)

    alone = {r: run([r]) for r in (0, 1, 7, 16, 17, 39)}
    gen = torch.Generator().manual_seed(3)
    for rows, align_kernel in [
        (list(range(2)), None), (list(range(17)), True), (list(range(40)), False), (list(range(40)), True),
        (torch.randperm(40, generator=gen).tolist(), None),  # another batch order
        ([39, 17, 0], False),
    ]:
        out = run(rows, align_kernel)
        for i, r in enumerate(rows):
            if r in alone:
                assert torch.equal(out[i : i + 1], alone[r]), f"token {r} differs among {len(rows)} ({align_kernel})"
    got = run(list(range(40))).double()
    want = experts_forward_torch(x.double().cpu(), gate_up.double().cpu(), down.double().cpu(), weights.cpu(),
                                 ids.cpu()) + shared.double().cpu()
    tol = 2e-2 if dtype == torch.float16 else 1e-5
    assert torch.allclose(got.cpu(), want, atol=tol, rtol=tol)
    # the torch form of the mode (the CPU's) keeps the same contract, in other bits
    torch_form = experts_forward_batch_invariant(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu(),
                                                 shared.cpu())
    assert torch.allclose(got.cpu(), torch_form.double(), atol=tol, rtol=tol)


def test_triton_experts_refuse_bad_inputs(interpreter_mode):
    from fixtures.triton_interpreter import import_interpreted

    kernels = import_interpreted("foretell.ops.moe.batch_invariant_triton")
    x, gate_up, down, weights, ids, shared = _expert_world(torch.float32, num_tokens=2)
    with pytest.raises(ValueError, match="one shape"):
        kernels.experts_forward_batch_invariant_triton(x, gate_up, down, weights[:, :2], ids)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32 experts"):
        kernels.batch_invariant_tiles(torch.float64)
    assert kernels.batch_invariant_tiles(torch.bfloat16) == kernels.batch_invariant_tiles(torch.float16)
