"""Kimi-K2.5's int4 experts (issue 25): the compressed-tensors pack-quantized format checked against
the compressed-tensors package itself (its pack_to_int32 / unpack_from_int32, calculate_qparams,
quantize, dequantize), the twin int4_experts_forward_torch against a float64 loop over tokens and
slots, and the int4 GEMV kernels (ops/moe/triton_int4_gemv.py) against the twin in Triton's
interpreter (fp16 scales: the interpreter keeps bf16 as uint16; bf16 and Kimi-K2.5's shapes are
tests/gpu/test_moe_int4_gpu.py's). Kernel buffers start poisoned; fresh random inputs every run, a
failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.moe import int4_reference as ref
from foretell.ops.moe.int4_dispatch import fused_int4_experts

# Imported while the test modules are collected: compressed-tensors imports triton too, and
# triton.language must first be imported with the interpreter on (fixtures/triton_interpreter.py).
int4_gemv = None if HAS_CUDA else import_interpreted("foretell.ops.moe.triton_int4_gemv")
ROUTED = 10


def _seed() -> int:
    return random.randrange(2**31)


# ---------------------------------------------------------------------- the format, against compressed-tensors


@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    # Kimi-K2.5's config.json: quantization_config.config_groups.group_0.weights
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    return dict(pack=pack_to_int32, unpack=unpack_from_int32, args=args, quantize=quantize, dequantize=dequantize,
                qparams=calculate_qparams)


@pytest.mark.parametrize("shape", [(6, 96), (3, 5, 70), (17, 8), (1, 1)])
def test_packing_matches_compressed_tensors(ct, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    theirs = ct["pack"](q, 4)
    assert torch.equal(ref.pack_int4(q), theirs)
    assert torch.equal(ref.unpack_int4(theirs, shape[-1]), q)
    assert torch.equal(ct["unpack"](ref.pack_int4(q), 4, torch.Size(shape)), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantization_matches_compressed_tensors(ct, dtype):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 24, 160
    w = (torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))).to(dtype)
    w[3, 32:64] = 0  # an all-zero group: the eps scale
    grouped = w.view(n, k // 32, 32)
    scale, zero_point = ct["qparams"](grouped.amin(-1), grouped.amax(-1), ct["args"])
    q_theirs = ct["quantize"](w, scale, zero_point, ct["args"], dtype=torch.int8)
    q, our_scale = ref.quantize_int4_groups(w)
    with reports_seed(seed):
        assert torch.equal(our_scale, scale) and torch.equal(q, q_theirs)
        dequantized = ct["dequantize"](q_theirs, scale, zero_point, ct["args"])
        assert torch.equal(ref.dequantize_int4(ref.pack_int4(q), our_scale, k), dequantized)


def test_pack_rejects_values_out_of_range():
    with pytest.raises(ValueError, match=r"integers in \[-8, 7\]"):
        ref.pack_int4(torch.tensor([[8]], dtype=torch.int8))
    with pytest.raises(ValueError, match="integers"):
        ref.pack_int4(torch.zeros(2, 8))


# ---------------------------------------------------------------------- the experts


def int4_moe_case(num_tokens, top_k, hidden, inter, dtype, gen, with_shared=False):
    """x [T, H], packed experts and their scales in `dtype`, weights / ids [T, top_k] (distinct
    routed experts per token), shared [T, H] or None."""
    ids = torch.stack([torch.randperm(ROUTED, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = torch.randn(ROUTED, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(ROUTED, hidden, inter, generator=gen) / inter**0.5
    gu_q, gu_s = ref.quantize_int4_groups(gate_up.to(dtype))
    d_q, d_s = ref.quantize_int4_groups(down.to(dtype))
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_shared else None
    return x, ref.pack_int4(gu_q), gu_s, ref.pack_int4(d_q), d_s, weights, ids, shared


def test_twin_matches_a_float64_loop():
    """Per token and slot: the expert's weights dequantized (q * scale, rounded to the scales'
    dtype), its SwiGLU MLP in float64, weighted and summed; the twin rounds where the model dtype
    does, so they agree to a few roundings of it."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    x, gu_p, gu_s, d_p, d_s, weights, ids, _ = int4_moe_case(3, 4, 72, 40, dtype, gen)  # H = 72: a ragged group
    got = ref.int4_experts_forward_torch(x, gu_p, gu_s, d_p, d_s, weights, ids)
    expected = torch.zeros(3, 72, dtype=torch.float64)
    for t in range(3):
        for slot in range(4):
            e = int(ids[t, slot])
            gate_up = (ref.unpack_int4(gu_p[e], 72).to(dtype) * gu_s[e].repeat_interleave(32, -1)[:, :72]).double()
            down = (ref.unpack_int4(d_p[e], 40).to(dtype) * d_s[e].repeat_interleave(32, -1)[:, :40]).double()
            gate, up = (x[t].double() @ gate_up.t()).chunk(2)
            expected[t] += weights[t, slot].double() * (down @ (F.silu(gate) * up))
    with reports_seed(seed):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())


def test_dispatch_on_cpu_is_the_twin_and_checks_inputs():
    gen = torch.Generator().manual_seed(3)
    x, gu_p, gu_s, d_p, d_s, weights, ids, shared = int4_moe_case(2, 3, 64, 32, torch.float32, gen, True)
    want = ref.int4_experts_forward_torch(x, gu_p, gu_s, d_p, d_s, weights, ids) + shared
    assert torch.equal(fused_int4_experts(x, gu_p, gu_s, d_p, d_s, weights, ids, shared), want)
    with pytest.raises(ValueError, match=r"gate_up: weight_packed \[10, 64, 7\] does not hold K=64"):
        fused_int4_experts(x, gu_p[..., :7], gu_s, d_p, d_s, weights, ids)
    with pytest.raises(ValueError, match=r"down: weight_scale must be a float \[10, 64, 1\]"):
        fused_int4_experts(x, gu_p, gu_s, d_p, d_s[..., :0], weights, ids)
    with pytest.raises(ValueError, match=r"down weight_packed must be \[E=10, H=64"):
        fused_int4_experts(x, gu_p, gu_s, d_p[:, :5], d_s, weights, ids)
    with pytest.raises(ValueError, match="weights must have the shape of ids"):
        fused_int4_experts(x, gu_p, gu_s, d_p, d_s, weights[:, :2], ids)


# ---------------------------------------------------------------------- the kernels (interpreter)


@pytest.fixture
def kernels():
    if int4_gemv is None:
        pytest.skip("on a GPU the kernels are tested in tests/gpu/test_moe_int4_gpu.py")
    return int4_gemv


def poison_buffers(monkeypatch):
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


SMALL_TILES = {"gate_up": {"BLOCK_N": 32, "BLOCK_K": 32}, "down": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT": 2}}
TILE_LANES = {"gate_up": {"LANES": False}, "down": {"LANES": False}}  # x's lanes made in every tile
SMALL_TILE_LANES = {name: {**tiles, "LANES": False} for name, tiles in SMALL_TILES.items()}


@pytest.mark.parametrize(
    "num_tokens, top_k, hidden, inter, with_shared, config",
    [(1, 8, 96, 64, True, None), (2, 2, 72, 40, False, None), (2, 3, 96, 72, True, SMALL_TILES),
     (1, 1, 64, 32, False, {"down": {"SPLIT": 1}}), (1, 8, 96, 64, True, TILE_LANES),
     (2, 2, 72, 40, False, TILE_LANES), (2, 3, 96, 72, True, SMALL_TILE_LANES),
     (1, 1, 64, 32, False, {"gate_up": {"LANES": False}, "down": {"SPLIT": 1}}),
     (3, 2, 160, 96, True, {"gate_up": {"BLOCK_N": 8, "BLOCK_K": 64},
                            "down": {"BLOCK_N": 2, "BLOCK_K": 64, "SPLIT": 1}}),
     (1, 1, 2056, 16, False, {"gate_up": {"BLOCK_N": 4, "BLOCK_K": 8192}})],
)
def test_kernels_match_the_twin(kernels, num_tokens, top_k, hidden, inter, with_shared, config, monkeypatch):
    """Default tiles (one K chunk) and small ones (several chunks, a partial one; the down slot
    split in two); H = 72: a group of 8 columns past the last full one; fp16 and float32 scales;
    the kernels over x's lanes (the default) and those making the lanes in every tile (LANES False),
    together and mixed; H = 2056 over 8192-column tiles: lanes padded past the lanes kernel's
    first blocks (257 words to 1,024)."""
    poison_buffers(monkeypatch)
    seed = _seed()
    for dtype, tolerance in ((torch.float16, 2e-2), (torch.float32, 1e-4)):
        gen = torch.Generator().manual_seed(seed)
        x, gu_p, gu_s, d_p, d_s, weights, ids, shared = int4_moe_case(num_tokens, top_k, hidden, inter, dtype, gen,
                                                                       with_shared)
        want = ref.int4_experts_forward_torch(x, gu_p, gu_s, d_p, d_s, weights, ids)
        want = want if shared is None else want + shared
        got = kernels.fused_int4_experts_gemv_triton(x, gu_p, gu_s, d_p, d_s, weights, ids, shared, config=config)
        with reports_seed(seed):
            assert got.dtype == torch.float32 and not torch.isnan(got).any()
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_kernel_config_errors_name_the_key(kernels):
    gen = torch.Generator().manual_seed(0)
    case = int4_moe_case(1, 2, 64, 32, torch.float32, gen)
    with pytest.raises(ValueError, match=r"unknown int4 MoE down config keys \['BLOCK'\]"):
        kernels.fused_int4_experts_gemv_triton(*case, config={"down": {"BLOCK": 4}})
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two >= 32"):
        kernels.fused_int4_experts_gemv_triton(*case, config={"gate_up": {"BLOCK_K": 16}})
