"""The GEMV MoE path (ops/moe/triton_gemv.py) on a CUDA device: bf16 and fp16 at DeepSeek-V2-Lite's
shapes (64 routed + 2 shared experts, 6 + 2 per token, hidden 2048, intermediate 1408) and a small
odd one, against the torch twin and against the grouped path; the slot split of the down kernel
repeated many times (its last-to-arrive sum must not race); the launch configs the benchmark
sweeps; no host sync, and capture and replay inside a CUDA graph.

Every case draws fresh random inputs; a failure prints the seed that reproduces it.
"""

from __future__ import annotations

import random

import pytest
import torch


from foretell.ops.moe.reference import experts_forward_torch
from foretell.ops.moe.triton_gemv import GEMV_MAX_TOKENS, fused_experts_gemv_triton
from foretell.ops.moe.triton_experts import fused_experts_triton

DEVICE = torch.device("cuda")
V2_LITE = {"routed": 64, "shared": 2, "top_k": 6, "hidden": 2048, "inter": 1408}
SMALL = {"routed": 8, "shared": 1, "top_k": 3, "hidden": 320, "inter": 176}  # not multiples of the tiles
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _seed() -> int:
    return random.randrange(2**31)


def experts(routed, shared, hidden, inter, dtype, gen):
    """gate_up [E + S, 2I, H], down [E + S, H, I]: the routed experts, then the shared ones."""
    num_experts = routed + shared
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=DEVICE) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen, device=DEVICE) / inter**0.5).to(dtype)
    return gate_up, down


def tokens(num_tokens, routed, shared, top_k, hidden, dtype, gen):
    """x [T, H], weights / ids [T, top_k + S] with the S shared experts last (weight 1, every
    token) as MoE.forward routes, and the shared output [T, H]."""
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    ids = torch.rand(num_tokens, routed, generator=gen, device=DEVICE).topk(top_k, dim=-1).indices
    shared_ids = torch.arange(routed, routed + shared, device=DEVICE).expand(num_tokens, shared)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=DEVICE)
    weights = torch.cat([weights, torch.ones(num_tokens, shared, device=DEVICE)], dim=1)
    shared_out = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    return x, weights, torch.cat([ids, shared_ids], dim=1), shared_out


def moe_inputs(num_tokens, routed, shared, top_k, hidden, inter, dtype, seed):
    """x, gate_up, down, weights, ids, shared_out."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up, down = experts(routed, shared, hidden, inter, dtype, gen)
    x, weights, ids, shared_out = tokens(num_tokens, routed, shared, top_k, hidden, dtype, gen)
    return x, gate_up, down, weights, ids, shared_out


def reference(x, gate_up, down, weights, ids, shared, out_dtype):
    out = experts_forward_torch(x, gate_up, down, weights, ids)  # [T, H] float32
    return (out if shared is None else out + shared).to(out_dtype)


def check(got, expected, dtype, what):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < tol / 3, f"{what}: relative error {rel}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 8])
@pytest.mark.parametrize("dims", [V2_LITE, SMALL], ids=["v2_lite", "small"])
def test_gemv_matches_torch_and_grouped(dims, num_tokens, dtype):
    seed = _seed()
    x, gate_up, down, weights, ids, shared = moe_inputs(num_tokens, dtype=dtype, seed=seed, **dims)
    for with_shared, out_dtype in ((False, torch.float32), (True, dtype)):
        s = shared if with_shared else None
        expected = reference(x, gate_up, down, weights, ids, s, out_dtype)
        got = fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=s, out_dtype=out_dtype)
        assert got.dtype == out_dtype and not got.isnan().any()
        check(got, expected, dtype, f"gemv vs torch, shared={with_shared} (seed {seed})")
        grouped = fused_experts_triton(x, gate_up, down, weights, ids, shared=s, out_dtype=out_dtype,
                                       path="grouped")
        check(got, grouped, dtype, f"gemv vs grouped, shared={with_shared} (seed {seed})")


def test_slot_split_is_race_free():
    """SPLIT 2 and 8 (the last of a column block's programs to arrive sums the slots it did not
    compute) equal SPLIT 1 bit for bit, over many launches."""
    seed = _seed()
    x, gate_up, down, weights, ids, shared = moe_inputs(1, dtype=torch.bfloat16, seed=seed, **V2_LITE)
    want = fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=shared, config={"SPLIT": 1})
    for split in (2, 8):
        for launch in range(50):
            got = fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=shared, config={"SPLIT": split})
            assert torch.equal(got, want), f"SPLIT {split}, launch {launch} (seed {seed})"


SWEPT = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
         for n, k, w, s in ((8, 512, 4, 1), (16, 256, 4, 3), (32, 128, 2, 4), (64, 256, 8, 2))]


@pytest.mark.parametrize("config", SWEPT, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_swept_configs_compile_and_match(config):
    seed = _seed()
    x, gate_up, down, weights, ids, shared = moe_inputs(3, dtype=torch.bfloat16, seed=seed, **SMALL)
    expected = reference(x, gate_up, down, weights, ids, shared, torch.bfloat16)
    for split in (1, 3):
        got = fused_experts_gemv_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=torch.bfloat16,
                                        config={**config, "SPLIT": split})
        check(got, expected, torch.bfloat16, f"{config} SPLIT {split} (seed {seed})")


def test_gemv_no_sync_and_graph_replay():
    """fused_experts_triton (path by size: gemv) captured at 1 and GEMV_MAX_TOKENS tokens with the
    shared output; replayed with new tokens, weights and routings, one with every token on the
    same experts."""
    seed = _seed()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dims = {k: V2_LITE[k] for k in ("routed", "shared", "top_k", "hidden")}
    gate_up, down = experts(V2_LITE["routed"], V2_LITE["shared"], V2_LITE["hidden"], V2_LITE["inter"],
                            torch.bfloat16, gen)
    sizes = (1, GEMV_MAX_TOKENS)
    statics = [list(tokens(n, dtype=torch.bfloat16, gen=gen, **dims)) for n in sizes]  # x, weights, ids, shared

    def forward(x, weights, ids, shared):
        return fused_experts_triton(x, gate_up, down, weights, ids, shared=shared, out_dtype=torch.bfloat16)

    for s in statics:
        forward(*s)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in statics:
            forward(*s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graphs, outs = [], []
    for s in statics:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(forward(*s))
        graphs.append(graph)
    for replay in range(3):
        for n, static, graph, out in zip(sizes, statics, graphs, outs):
            x2, w2, ids2, shared2 = tokens(n, dtype=torch.bfloat16, gen=gen, **dims)
            if replay == 2:
                ids2[:] = ids2[0]  # every token on the same experts
            for dst, src in zip(static, (x2, w2, ids2, shared2)):
                dst.copy_(src)
            graph.replay()
            expected = reference(x2, gate_up, down, w2, ids2, shared2, torch.bfloat16)
            check(out, expected, torch.bfloat16, f"{n} tokens, replay {replay} (seed {seed})")
