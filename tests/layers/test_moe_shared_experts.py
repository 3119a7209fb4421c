"""Shared experts packed after the routed ones: the checkpoint's shared_experts tensors
([n * I, H] gate / up, [H, n * I] down) cut into n experts of I; the router appends them to every
token's choice with weight 1; the layer then equals routed experts + one shared MLP of n * I
computed in float64. Bad shapes and shards are refused with what was expected."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foretell.layers.moe import MoE, expert_weight_rules
from foretell.ops.moe.reference import RouterConfig


def shared_checkpoint(n: int, inter: int, hidden: int, gen) -> dict[str, torch.Tensor]:
    return {
        "gate": torch.randn(n * inter, hidden, generator=gen) / hidden**0.5,
        "up": torch.randn(n * inter, hidden, generator=gen) / hidden**0.5,
        "down": torch.randn(hidden, n * inter, generator=gen) / (n * inter) ** 0.5,
    }


def load_moe(config: RouterConfig, inter: int, hidden: int, gen) -> tuple[MoE, dict]:
    moe = MoE(config, hidden, inter, dtype=torch.float32, device="cpu")
    experts = moe.experts
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(config.num_experts, hidden, generator=gen))
        for e in range(config.num_experts):
            for part in range(2):
                experts.gate_up_proj.weight_loader(experts.gate_up_proj, torch.randn(inter, hidden, generator=gen), (e, part))
            experts.down_proj.weight_loader(experts.down_proj, torch.randn(hidden, inter, generator=gen), e)
    shared = shared_checkpoint(config.num_shared_experts, inter, hidden, gen)
    experts.gate_up_proj.weight_loader(experts.gate_up_proj, shared["gate"], ("shared", 0))
    experts.gate_up_proj.weight_loader(experts.gate_up_proj, shared["up"], ("shared", 1))
    experts.down_proj.weight_loader(experts.down_proj, shared["down"], "shared")
    return moe, shared


@pytest.mark.parametrize("num_shared", [1, 2, 3])
def test_layer_equals_routed_plus_one_shared_mlp(num_shared):
    gen = torch.Generator().manual_seed(num_shared)
    config = RouterConfig(8, 2, "softmax", "greedy", routed_scaling_factor=1.5, num_shared_experts=num_shared)
    inter, hidden = 12, 16
    moe, shared = load_moe(config, inter, hidden, gen)
    x = torch.randn(5, hidden, generator=gen)  # [T, H]
    weights, ids = moe.gate(x)
    assert ids.shape == (5, 2 + num_shared)
    assert ids[:, 2:].tolist() == [list(range(8, 8 + num_shared))] * 5 and (weights[:, 2:] == 1).all()
    # Reference in float64: the routed experts, plus the checkpoint's shared MLP as one block.
    xd = x.double()
    gate_up, down = moe.experts.gate_up_proj.double(), moe.experts.down_proj.double()
    expected = torch.zeros(5, hidden, dtype=torch.float64)
    for t in range(5):
        for k in range(2):
            e = ids[t, k].item()
            g, u = (gate_up[e] @ xd[t]).chunk(2)
            expected[t] += weights[t, k].double() * (down[e] @ (F.silu(g) * u))
    mlp = F.linear(F.silu(F.linear(xd, shared["gate"].double())) * F.linear(xd, shared["up"].double()),
                   shared["down"].double())
    torch.testing.assert_close(moe(x).double(), expected + mlp, rtol=1e-5, atol=1e-5)


def test_rules_route_shared_tensors_to_the_packed_parameters():
    rules = expert_weight_rules()

    def mapped(name):
        return next(r.apply(name) for r in rules if r.apply(name) is not None)

    assert mapped("model.layers.3.mlp.shared_experts.gate_proj.weight") == ("model.layers.3.mlp.experts.gate_up_proj", ("shared", 0))
    assert mapped("model.layers.3.mlp.shared_experts.up_proj.weight") == ("model.layers.3.mlp.experts.gate_up_proj", ("shared", 1))
    assert mapped("model.layers.3.mlp.shared_experts.down_proj.weight") == ("model.layers.3.mlp.experts.down_proj", "shared")
    assert mapped("model.layers.3.mlp.experts.7.up_proj.weight") == ("model.layers.3.mlp.experts.gate_up_proj", (7, 1))


def test_bad_shared_shapes_and_shards_are_refused():
    config = RouterConfig(4, 2, num_shared_experts=2)
    moe = MoE(config, 16, 12, dtype=torch.float32, device="cpu")
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    assert ("shared", 0) in gate_up.shard_ids and "shared" in down.shard_ids
    with pytest.raises(ValueError, match=r"shared experts' part 0: expected shape \(24, 16\)"):
        gate_up.weight_loader(gate_up, torch.zeros(12, 16), ("shared", 0))
    with pytest.raises(ValueError, match=r"shared experts' down_proj: expected shape \(16, 24\)"):
        down.weight_loader(down, torch.zeros(24, 16), "shared")
    with pytest.raises(ValueError, match="packed experts parameter of 4 experts got shard 4"):
        down.weight_loader(down, torch.zeros(16, 12), 4)  # slot 4 is a shared expert's, not routed
    no_shared = MoE(RouterConfig(4, 2), 16, 12, dtype=torch.float32, device="cpu").experts.down_proj
    with pytest.raises(ValueError, match="got shard 'shared'"):
        no_shared.weight_loader(no_shared, torch.zeros(16, 24), "shared")
    with pytest.raises(ValueError, match="n_shared_experts must be >= 0"):
        RouterConfig(4, 2, num_shared_experts=-1)
