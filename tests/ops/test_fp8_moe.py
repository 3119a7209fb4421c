"""FP8 experts (issue 25: DeepSeek-V3 / Kimi-K2 routed and shared experts as they ship): the twin
fp8_experts_forward_torch against a float64 loop over tokens and slots, the dispatch on CPU, and
the FP8 GEMV kernels (ops/moe/fp8_triton_gemv.py) against the twin in Triton's interpreter (x in
fp16 and float32: the interpreter keeps bf16 as uint16). Kernel buffers start poisoned; fresh
random inputs every run, a failure prints the seed. Also PackedExperts.quantize_fp8_ (what
quantization="fp8" does to float experts) against the twin.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.layers.packed_experts import PackedExperts
from foretell.ops.gemm.fp8_reference import quantize_fp8_blocks
from foretell.ops.moe import fp8_reference as ref
from foretell.ops.moe.fp8_dispatch import fused_fp8_experts

fp8_gemv = None if HAS_CUDA else import_interpreted("foretell.ops.moe.fp8_triton_gemv")
ROUTED = 10


def _seed() -> int:
    return random.randrange(2**31)


def quantize_experts(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:  # [E, N, K] -> fp8, scales
    parts = [quantize_fp8_blocks(w[e], block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def fp8_moe_case(num_tokens, top_k, hidden, inter, dtype, block, gen, with_shared=False):
    ids = torch.stack([torch.randperm(ROUTED, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gu_q, gu_s = quantize_experts(torch.randn(ROUTED, 2 * inter, hidden, generator=gen) / hidden**0.5, block)
    d_q, d_s = quantize_experts(torch.randn(ROUTED, hidden, inter, generator=gen) / inter**0.5, block)
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_shared else None
    return x, gu_q, gu_s, d_q, d_s, tuple(block), weights, ids, shared


def block_loop_dequantize(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:  # [N, K] float64
    out = q.double()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= s[i, j].double()
    return out


def test_twin_matches_a_float64_loop():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    block = (16, 32)
    x, gu_q, gu_s, d_q, d_s, block, weights, ids, _ = fp8_moe_case(3, 4, 72, 40, torch.float32, block, gen)
    got = ref.fp8_experts_forward_torch(x, gu_q, gu_s, d_q, d_s, block, weights, ids)
    expected = torch.zeros(3, 72, dtype=torch.float64)
    for t in range(3):
        for slot in range(4):
            e = int(ids[t, slot])
            gate, up = (x[t].double() @ block_loop_dequantize(gu_q[e], gu_s[e], block).t()).chunk(2)
            expected[t] += weights[t, slot].double() * (block_loop_dequantize(d_q[e], d_s[e], block) @ (F.silu(gate) * up))
    with reports_seed(seed):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_dispatch_on_cpu_is_the_twin_and_checks_inputs():
    gen = torch.Generator().manual_seed(3)
    x, gu_q, gu_s, d_q, d_s, block, weights, ids, shared = fp8_moe_case(2, 3, 64, 32, torch.float32, (32, 32), gen,
                                                                         True)
    want = ref.fp8_experts_forward_torch(x, gu_q, gu_s, d_q, d_s, block, weights, ids) + shared
    assert torch.equal(fused_fp8_experts(x, gu_q, gu_s, d_q, d_s, block, weights, ids, shared), want)
    with pytest.raises(ValueError, match=r"gate_up_scale must be torch.float32 \[10, 2, 2\]"):
        fused_fp8_experts(x, gu_q, gu_s[:, :1], d_q, d_s, block, weights, ids)
    with pytest.raises(ValueError, match=r"down must be torch.float8_e4m3fn \[10, 64, 32\]"):
        fused_fp8_experts(x, gu_q, gu_s, d_q.float(), d_s, block, weights, ids)
    with pytest.raises(ValueError, match="weights must have the shape of ids"):
        fused_fp8_experts(x, gu_q, gu_s, d_q, d_s, block, weights[:, :2], ids)


def test_quantize_fp8_turns_float_experts_into_the_fp8_layout():
    gen = torch.Generator().manual_seed(5)
    experts = PackedExperts(4, 64, 48, num_shared=1, dtype=torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(5, 96, 64, generator=gen) / 8)
        experts.down_proj.copy_(torch.randn(5, 64, 48, generator=gen) / 7)
    gate_up, down = experts.gate_up_proj.clone(), experts.down_proj.clone()
    experts.quantize_fp8_((32, 32))
    assert experts.format == "fp8" and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj_scale_inv.shape == (5, 3, 2) and experts.down_proj_scale_inv.shape == (5, 2, 2)
    x = torch.randn(3, 64, generator=gen)
    ids, weights = torch.tensor([[0, 4], [3, 4], [1, 4]]), torch.rand(3, 2, generator=gen)
    got = experts(x, weights, ids)
    want = ref.fp8_experts_forward_torch(x, *quantize_experts(gate_up, (32, 32)), *quantize_experts(down, (32, 32)),
                                         (32, 32), weights, ids)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------- the kernels (interpreter)


@pytest.fixture
def kernels():
    if fp8_gemv is None:
        pytest.skip("on a GPU the kernels are tested in tests/gpu/test_moe_fp8_gpu.py")
    return fp8_gemv


def poison_buffers(monkeypatch):
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


SMALL_TILES = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 32}, "down": {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT": 2}}
PER_WEIGHT_SCALES = {"gate_up": {"SCALE_X": False}, "down": {"SCALE_X": False}}  # each weight scaled, rounded


@pytest.mark.parametrize(
    "num_tokens, top_k, hidden, inter, block, with_shared, config",
    [(1, 4, 96, 64, (32, 32), True, None), (2, 2, 72, 48, (16, 64), False, None),
     (2, 3, 96, 72, (32, 16), True, SMALL_TILES), (1, 1, 64, 32, (32, 32), False, {"down": {"SPLIT": 1}}),
     (1, 4, 96, 64, (32, 32), True, PER_WEIGHT_SCALES), (2, 3, 96, 72, (4, 32), True, None)],
)
def test_kernels_match_the_twin(kernels, num_tokens, top_k, hidden, inter, block, with_shared, config, monkeypatch):
    """Default tiles (one K chunk, several quant blocks a tile) and small ones (several chunks, a
    partial one, quant blocks wider than a tile; the down slot split in two); ragged blocks at
    H = 72 and I = 72; fp16 and float32 x (the model dtype the weights round to). The block scales
    go onto x (SCALE_X) where a program's rows share a block row; each weight scaled where they do
    not (SMALL_TILES' gate_up: I = 72 is no multiple of 16 rows; 4-row blocks) or SCALE_X is off."""
    poison_buffers(monkeypatch)
    seed = _seed()
    for dtype, tolerance in ((torch.float16, 2e-2), (torch.float32, 1e-4)):
        gen = torch.Generator().manual_seed(seed)
        x, gu_q, gu_s, d_q, d_s, blk, weights, ids, shared = fp8_moe_case(num_tokens, top_k, hidden, inter, dtype,
                                                                          block, gen, with_shared)
        want = ref.fp8_experts_forward_torch(x, gu_q, gu_s, d_q, d_s, blk, weights, ids)
        want = (want if shared is None else want + shared).to(dtype)
        got = kernels.fused_fp8_experts_gemv_triton(x, gu_q, gu_s, d_q, d_s, blk, weights, ids, shared, config=config)
        with reports_seed(seed):
            assert got.dtype == dtype and not torch.isnan(got).any()
            torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


def test_kernel_config_errors_name_the_key(kernels):
    gen = torch.Generator().manual_seed(0)
    case = fp8_moe_case(1, 2, 64, 32, torch.float32, (32, 32), gen)
    with pytest.raises(ValueError, match=r"unknown FP8 MoE down config keys \['BLOCK'\]"):
        kernels.fused_fp8_experts_gemv_triton(*case, config={"down": {"BLOCK": 4}})
    odd = fp8_moe_case(1, 2, 64, 48, torch.float32, (32, 24), gen)  # the dispatch sends these to the twin
    with pytest.raises(ValueError, match=r"power-of-two block width, got \[32, 24\]"):
        kernels.fused_fp8_experts_gemv_triton(*odd)
