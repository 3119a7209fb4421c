"""The word_tiles variant of the int4 MoE GEMV (ops/moe/triton_int4_word_tiles.py: x loaded in the
packed words' tile shape) in Triton's interpreter: the same bits as the nibble_lanes kernels at the
same tiles (the arithmetic is theirs, operation for operation), the twin int4_experts_forward_torch
and a float64 loop over tokens and slots at odd shapes (N not a multiple of BLOCK_N, K a multiple of
the group only or not even that, whole tiles with no mask, an expert shared by tokens, a token routed
to one expert twice), the launch config's "variant" key and candidate_configs, and bad input.
fp16 and float32 (the interpreter keeps bf16 as uint16; bf16 and Kimi-K2.5's shapes are
tests/gpu/test_moe_int4_words_gpu.py's). Kernel buffers start poisoned; a failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.moe import int4_reference as ref

# Imported while the test modules are collected (fixtures/triton_interpreter.py); the word_tiles
# module first, so the launcher's import of it finds the interpreted one.
word_tiles = None if HAS_CUDA else import_interpreted("foretell.ops.moe.triton_int4_word_tiles")
int4_gemv = None if HAS_CUDA else import_interpreted("foretell.ops.moe.triton_int4_gemv")
EXPERTS = 6


@pytest.fixture
def kernels():
    if int4_gemv is None:
        pytest.skip("on a GPU the kernels are tested in tests/gpu/test_moe_int4_words_gpu.py")
    return int4_gemv


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


def moe_case(num_tokens, hidden, inter, dtype, gen, ids, with_shared=True):
    """x [T, H], packed experts with `dtype` scales (compressed-tensors' quantization of random
    weights), routing weights for ids [T, top_k], shared [T, H] or None."""
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gu_q, gu_s = ref.quantize_int4_groups((torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype))
    d_q, d_s = ref.quantize_int4_groups((torch.randn(EXPERTS, hidden, inter, generator=gen) / inter**0.5).to(dtype))
    weights = torch.rand(ids.shape, generator=gen) * 2.8
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_shared else None
    return x, ref.pack_int4(gu_q), gu_s, ref.pack_int4(d_q), d_s, weights, ids, shared


def both(gate_up: dict, down: dict, variant: str) -> dict:
    return {"gate_up": {"variant": variant, **gate_up}, "down": {"variant": variant, **down}}


def float64_experts(x, gu_p, gu_s, d_p, d_s, weights, ids):
    """Per token and slot, in float64: the expert's dequantized weights (q * scale), its SwiGLU MLP,
    weighted and summed. No rounding to the model dtype between the steps."""
    hidden, inter = x.shape[1], gu_p.shape[1] // 2
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate_up = ref.unpack_int4(gu_p[e], hidden).double() * gu_s[e].double().repeat_interleave(32, -1)[:, :hidden]
            down = ref.unpack_int4(d_p[e], inter).double() * d_s[e].double().repeat_interleave(32, -1)[:, :inter]
            gate, up = (gate_up @ x[t].double()).chunk(2)
            out[t] += weights[t, slot].double() * (down @ (F.silu(gate) * up))
    return out


# (num_tokens, hidden, inter, ids, gate_up tiles, down tiles, dtype): what each case holds. Wide row
# blocks keep the interpreter's program count (and time) small.
CASES = {
    # H = 72: the last group holds 8 columns (K not a multiple of the group); I = 40: N of gate_up not a
    # multiple of BLOCK_N 32, H not of down's 64; two K tiles a row of gate_up, the second partial
    "ragged group, partial rows": (2, 72, 40, [[0, 3, 5], [5, 1, 3]], {"BLOCK_N": 32, "BLOCK_K": 64},
                                   {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT": 2}, torch.float16),
    # H = 96: K whole groups but not whole 64-column tiles; down split one slot a program
    "whole groups, partial tiles": (1, 96, 64, [[2, 4, 0]], {"BLOCK_N": 64, "BLOCK_K": 64},
                                    {"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT": 3}, torch.float32),
    # H = 128, I = 64: whole tiles (EVEN_K, no mask in the loop), rows past N clamped (down: BLOCK_N
    # 256 > H); every token to expert 2, token 1 to expert 4 twice; down unsplit
    "whole tiles, an expert twice": (3, 128, 64, [[2, 1], [4, 4], [2, 2]], {"BLOCK_N": 64, "BLOCK_K": 64},
                                     {"BLOCK_N": 256, "BLOCK_K": 32, "SPLIT": 1}, torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_word_tiles_match_the_twin_and_the_lanes_kernels(kernels, case):
    num_tokens, hidden, inter, ids, gate_up, down, dtype = CASES[case]
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    args = moe_case(num_tokens, hidden, inter, dtype, gen, torch.tensor(ids))
    want = ref.int4_experts_forward_torch(*args[:7]) + args[7]
    got = kernels.fused_int4_experts_gemv_triton(*args, config=both(gate_up, down, "word_tiles"))
    lanes = kernels.fused_int4_experts_gemv_triton(*args, config=both(gate_up, down, "nibble_lanes"))
    with reports_seed(seed):
        assert got.dtype == torch.float32 and not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        assert torch.equal(got, lanes)  # the same values / 16 in the same order: the same roundings


def test_word_tiles_against_a_float64_loop(kernels):
    """float32 scales and x: the kernel's only roundings are float32 ones (the twin's too), so it
    agrees with exact arithmetic to float32's precision."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    args = moe_case(2, 96, 72, torch.float32, gen, torch.tensor([[1, 5, 1], [0, 5, 2]]), with_shared=False)
    got = kernels.fused_int4_experts_gemv_triton(
        *args, config=both({"BLOCK_N": 64, "BLOCK_K": 32}, {"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT": 3}, "word_tiles"))
    want = float64_experts(*args[:7])
    with reports_seed(seed):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_one_kernel_each_variant(kernels):
    """The variant is per kernel: word_tiles gate_up before the nibble_lanes down and the reverse
    give the lanes kernels' bits too."""
    gen = torch.Generator().manual_seed(7)
    args = moe_case(1, 64, 32, torch.float16, gen, torch.tensor([[3, 0]]))
    tiles = {"gate_up": {"BLOCK_N": 32, "BLOCK_K": 32}, "down": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT": 2}}
    lanes = kernels.fused_int4_experts_gemv_triton(*args, config=tiles)
    for words_kernel in ("gate_up", "down"):
        config = {name: dict(cfg, variant="word_tiles" if name == words_kernel else "nibble_lanes")
                  for name, cfg in tiles.items()}
        assert torch.equal(kernels.fused_int4_experts_gemv_triton(*args, config=config), lanes)


def test_candidate_configs(kernels):
    """The default first (nibble_lanes, the launch default), every candidate resolvable as it is,
    word_tiles among them; one runs against the default on a small case."""
    candidates = kernels.candidate_configs(1, 8)
    assert candidates[0] == kernels.int4_launch_config(1, 8)
    assert {cfg["gate_up"]["variant"] for cfg in candidates} == set(kernels.INT4_VARIANTS)
    for cfg in candidates:
        assert kernels._resolve(cfg, 1, 8) == cfg
    gen = torch.Generator().manual_seed(1)
    args = moe_case(1, 128, 32, torch.float32, gen, torch.tensor([[0, 5]]))
    cfg = kernels.candidate_configs(1, 2)[-1]  # word_tiles down (16 x 256, K = 32: masked) after the lanes gate_up
    assert cfg["down"]["variant"] == "word_tiles"
    torch.testing.assert_close(kernels.fused_int4_experts_gemv_triton(*args, config=cfg),
                               kernels.fused_int4_experts_gemv_triton(*args), rtol=1e-4, atol=1e-4)


def test_bad_input_names_what_is_wrong(kernels):
    gen = torch.Generator().manual_seed(0)
    x, gu_p, gu_s, d_p, d_s, weights, ids, shared = moe_case(1, 64, 32, torch.float32, gen, torch.tensor([[0, 1]]))
    words = both({}, {}, "word_tiles")
    with pytest.raises(ValueError, match="variant must be one of"):
        kernels.fused_int4_experts_gemv_triton(x, gu_p, gu_s, d_p, d_s, weights, ids, config={"down": {"variant": "x"}})
    # packed along N instead of K: [E, 2I / 8, H] int32 words
    along_n = ref.pack_int4(ref.unpack_int4(gu_p, 64).transpose(1, 2)).transpose(1, 2).contiguous()
    with pytest.raises(ValueError, match=r"gate_up: weight_packed \[6, 8, 64\] does not hold K=64"):
        kernels.fused_int4_experts_gemv_triton(x, along_n, gu_s, d_p, d_s, weights, ids, config=words)
    with pytest.raises(ValueError, match=r"down: weight_packed .* does not hold K=32"):
        kernels.fused_int4_experts_gemv_triton(x, gu_p, gu_s, d_p.view(torch.int16)[..., :2].contiguous().view(
            torch.int32), d_s, weights, ids, config=words)
    with pytest.raises(ValueError, match="int32"):
        kernels.fused_int4_experts_gemv_triton(x, gu_p.to(torch.int64), gu_s, d_p, d_s, weights, ids, config=words)
    with pytest.raises(ValueError, match=r"unknown int4 MoE gate_up config keys \['VARIANT'\]"):
        kernels.fused_int4_experts_gemv_triton(x, gu_p, gu_s, d_p, d_s, weights, ids,
                                               config={"gate_up": {"VARIANT": "word_tiles"}})
