"""The int4 experts' tensor-core kernels (ops/moe/triton_int4_mma.py) against the torch twin
int4_experts_forward_torch and a float64 loop, in Triton's interpreter (fp16 and float32 scales:
the interpreter's tl.dot is wrong on bf16; bf16 and Kimi-K2.5's shapes are
tests/gpu/test_moe_int4_mma_gpu.py's), and the dispatch's rule for which kernel a step takes.

Covered: one token with 8 experts, 16 tokens, an expert routed to by more than 16 pairs (its rows
in two MMA chunks), the same expert twice in one token's top-k, K not a multiple of the group (32)
nor of the word (8), split-K in both kernels (the last-to-arrive sums), the shared output, and bad
configs. Kernel buffers start poisoned; fresh random inputs every run, a failure prints the seed.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.moe import int4_reference as ref
from foretell.ops.moe.int4_dispatch import INT4_MMA_MAX_TOKENS, int4_decode_kernel

int4_mma = None if HAS_CUDA else import_interpreted("foretell.ops.moe.triton_int4_mma")
EXPERTS = 10


@pytest.fixture
def kernels():
    if int4_mma is None:
        pytest.skip("on a GPU the kernels are tested in tests/gpu/test_moe_int4_mma_gpu.py")
    return int4_mma


def poison_buffers(monkeypatch):
    empty = torch.empty

    def poisoned(*shape, dtype=None, **kwargs):
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 2**30)

    monkeypatch.setattr(torch, "empty", poisoned)


def int4_case(ids, hidden, inter, dtype, gen, with_shared):
    """x [T, H], packed experts (quantized from random weights, scales in `dtype`), weights [T, top_k],
    shared [T, H] or None, for the given ids [T, top_k]."""
    num_tokens, top_k = ids.shape
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(EXPERTS, hidden, inter, generator=gen) / inter**0.5
    gu_q, gu_s = ref.quantize_int4_groups(gate_up.to(dtype))
    d_q, d_s = ref.quantize_int4_groups(down.to(dtype))
    weights = torch.rand(num_tokens, top_k, generator=gen)
    shared = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_shared else None
    return x, ref.pack_int4(gu_q), gu_s, ref.pack_int4(d_q), d_s, weights, ids, shared


def distinct_ids(num_tokens, top_k, gen):
    return torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])


def float64_loop(x, gu_p, gu_s, d_p, d_s, weights, ids, shared):
    """Per token and slot in float64, from the weights the twin dequantizes (q * scale in their dtype)."""
    hidden, inter = x.shape[1], gu_p.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate_up = ref.dequantize_int4(gu_p[e], gu_s[e], hidden).double()
            down = ref.dequantize_int4(d_p[e], d_s[e], inter).double()
            gate, up = (x[t].double() @ gate_up.t()).chunk(2)
            out[t] += weights[t, slot].double() * (down @ (F.silu(gate) * up))
    return out if shared is None else out + shared.double()


SMALL = {"gate_up": {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2},
         "down": {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}}
F16, F32 = torch.float16, torch.float32
CASES = {
    # id: (ids maker, hidden, inter, shared, config, dtypes)
    "t1-top8": (lambda g: distinct_ids(1, 8, g), 96, 64, True, None, (F16, F32)),
    "t16-top2": (lambda g: distinct_ids(16, 2, g), 64, 32, False, None, (F16,)),
    "expert-in-20-pairs": (  # its rows in two MMA chunks of 16
        lambda g: torch.cat([torch.full((10, 1), 4), distinct_ids(10, 1, g)], 1), 64, 32, True, None, (F16,)),
    "repeated-in-a-token": (lambda g: torch.tensor([[3, 3, 7], [7, 1, 7]]), 72, 40, False, None, (F16, F32)),
    "ragged-split-k": (lambda g: distinct_ids(3, 3, g), 200, 140, True, SMALL, (F16,)),
    "t1-split-k-partial-last": (lambda g: distinct_ids(1, 4, g), 296, 168, False,
                                {"gate_up": {"BLOCK_K": 128, "SPLIT_K": 2},
                                 "down": {"BLOCK_K": 128, "SPLIT_K": 2, "BLOCK_N": 64}}, (F32,)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mma_kernels_match_the_twin(kernels, case, monkeypatch):
    """Against the twin (the same roundings, sums in another order) and a float64 loop. H = 72, 200,
    296, I = 40, 140, 168: partial groups of 32; I = 140: a partial word (K not a multiple of 8);
    H = 296 split in two: the last split one partial K tile."""
    make_ids, hidden, inter, with_shared, config, dtypes = CASES[case]
    poison_buffers(monkeypatch)
    seed = random.randrange(2**31)
    for dtype in dtypes:
        tolerance = 2e-2 if dtype == F16 else 1e-4
        gen = torch.Generator().manual_seed(seed)
        x, gu_p, gu_s, d_p, d_s, weights, ids, shared = int4_case(make_ids(gen), hidden, inter, dtype, gen,
                                                                  with_shared)
        want = ref.int4_experts_forward_torch(x, gu_p, gu_s, d_p, d_s, weights, ids)
        want = want if shared is None else want + shared
        got = kernels.fused_int4_experts_mma_triton(x, gu_p, gu_s, d_p, d_s, weights, ids, shared, config=config)
        exact = float64_loop(x, gu_p, gu_s, d_p, d_s, weights, ids, shared)
        with reports_seed(seed):
            assert got.dtype == torch.float32 and not torch.isnan(got).any()
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
            scale = exact.abs().max().item()
            torch.testing.assert_close(got.double(), exact, rtol=0, atol=tolerance * 2 * scale)


def test_split_k_gives_the_unsplit_result_within_rounding(kernels):
    """Split-K changes the float32 sums' order only: each slot's output rounds to the model dtype, so
    split and unsplit agree to one rounding of it."""
    gen = torch.Generator().manual_seed(5)
    case = int4_case(distinct_ids(2, 3, gen), 384, 256, torch.float16, gen, True)
    unsplit = kernels.fused_int4_experts_mma_triton(*case, config={"gate_up": {"SPLIT_K": 1}, "down": {"SPLIT_K": 1}})
    split = kernels.fused_int4_experts_mma_triton(*case, config={"gate_up": {"SPLIT_K": 3}, "down": {"SPLIT_K": 2}})
    torch.testing.assert_close(split, unsplit, rtol=4e-3, atol=4e-3)


def test_no_pairs_give_the_shared_output(kernels):
    gen = torch.Generator().manual_seed(1)
    x, gu_p, gu_s, d_p, d_s, _, _, shared = int4_case(distinct_ids(2, 1, gen), 64, 32, torch.float16, gen, True)
    empty = torch.zeros(2, 0, dtype=torch.int64)
    got = kernels.fused_int4_experts_mma_triton(x, gu_p, gu_s, d_p, d_s, empty.float(), empty, shared)
    assert torch.equal(got, shared.float())


def test_launch_rule_fills_the_sms_with_split_k(kernels):
    """At Kimi-K2.5's shapes one token's 8 experts give 8 x 16 gate_up and 8 x 56 down programs:
    split along K to about 4 per SM of 132; 16 tokens' 128 pairs need no split."""
    one = kernels.int4_mma_launch_config(1, 8, 7168, 2048)
    assert one["gate_up"]["SPLIT_K"] == 5 and one["down"]["SPLIT_K"] == 2
    sixteen = kernels.int4_mma_launch_config(16, 8, 7168, 2048)
    assert sixteen["gate_up"]["SPLIT_K"] == 1 and sixteen["down"]["SPLIT_K"] == 1
    assert kernels.int4_mma_launch_config(1, 8, 7168, 2048, num_sms=264)["gate_up"]["SPLIT_K"] == 9
    assert kernels.int4_mma_launch_config(1, 1, 256, 128)["gate_up"]["SPLIT_K"] == 1  # K too short to split


def test_config_errors_name_the_key(kernels):
    gen = torch.Generator().manual_seed(0)
    case = int4_case(distinct_ids(1, 2, gen), 64, 32, torch.float16, gen, False)
    with pytest.raises(ValueError, match=r"unknown int4 MoE MMA down config keys \['SPLIT'\]"):
        kernels.fused_int4_experts_mma_triton(*case, config={"down": {"SPLIT": 4}})
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two >= 128"):
        kernels.fused_int4_experts_mma_triton(*case, config={"gate_up": {"BLOCK_K": 64}})
    with pytest.raises(ValueError, match="SPLIT_K must be an integer >= 1, got 0"):
        kernels.fused_int4_experts_mma_triton(*case, config={"gate_up": {"SPLIT_K": 0}})
    with pytest.raises(ValueError, match="config keys are 'gate_up' and 'down'"):
        kernels.fused_int4_experts_mma_triton(*case, config={"up": {}})


def test_dispatch_rule_names_the_kernel_per_step():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert int4_decode_kernel(1, cuda, torch.bfloat16, (9, 0)) == "mma"
    assert int4_decode_kernel(INT4_MMA_MAX_TOKENS, cuda, torch.float16, (8, 0)) == "mma"
    assert int4_decode_kernel(INT4_MMA_MAX_TOKENS + 1, cuda, torch.bfloat16, (9, 0)) == "dequantized"
    assert int4_decode_kernel(4, cuda, torch.float32, (9, 0)) == "gemv"  # tl.dot would round to tf32
    assert int4_decode_kernel(4, cuda, torch.bfloat16, (7, 5)) == "gemv"  # no bf16 tensor cores
    assert int4_decode_kernel(12, cuda, torch.float32, (9, 0)) == "dequantized"
    assert int4_decode_kernel(1, cpu, torch.bfloat16, None) == "torch"
