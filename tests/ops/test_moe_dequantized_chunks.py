"""ops/moe/dequantized_chunks.py: the quantized experts' prefill path dequantizing a chunk of used
experts at a time. On the CPU with the torch experts (reference.experts_forward_torch) as the
grouped function: every chunk size gives the twins' result (int4 and FP8), dequantizes no more than
its chunk at once, and bad sizes are refused. (On CUDA the dispatches run it with the Triton grouped
kernels: tests/gpu/test_moe_int4_gpu.py's many-token test.)
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.seeds import reports_seed
from foretell.ops.gemm.fp8_reference import quantize_fp8_blocks
from foretell.ops.moe import int4_reference as int4_ref
from foretell.ops.moe.dequantized_chunks import experts_in_chunks, experts_per_chunk
from foretell.ops.moe.fp8_reference import dequantize_fp8_experts, fp8_experts_forward_torch
from foretell.ops.moe.reference import experts_forward_torch

EXPERTS, HIDDEN, INTER = 9, 72, 40


def routing(num_tokens, top_k, gen):
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])  # [T, top_k]
    return torch.rand(num_tokens, top_k, generator=gen), ids


def int4_experts(gen, dtype):
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    gu_q, gu_s = int4_ref.quantize_int4_groups(gate_up.to(dtype))
    d_q, d_s = int4_ref.quantize_int4_groups(down.to(dtype))
    return int4_ref.pack_int4(gu_q), gu_s, int4_ref.pack_int4(d_q), d_s


class CountingDequantize:
    """int4 dequantization that records the most experts it was asked for at once."""

    def __init__(self, gu_p, gu_s, d_p, d_s):
        self.tensors, self.most = (gu_p, gu_s, d_p, d_s), 0

    def __call__(self, used):
        gu_p, gu_s, d_p, d_s = self.tensors
        self.most = max(self.most, used.numel())
        return (int4_ref.dequantize_int4(gu_p[used], gu_s[used], HIDDEN),
                int4_ref.dequantize_int4(d_p[used], d_s[used], INTER))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 2, 4, EXPERTS])
def test_every_chunk_size_gives_the_int4_twin(dtype, chunk):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    packed = int4_experts(gen, dtype)
    weights, ids = routing(11, 3, gen)
    x = torch.randn(11, HIDDEN, generator=gen).to(dtype)
    want = int4_ref.int4_experts_forward_torch(x, *packed, weights, ids)  # [T, H] float32
    dequantize = CountingDequantize(*packed)
    got = experts_in_chunks(x, weights, ids, dequantize, experts_forward_torch, chunk)
    with reports_seed(seed):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert dequantize.most <= chunk
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_experts_in_chunks_give_the_twin():
    gen = torch.Generator().manual_seed(3)
    dtype, block = torch.bfloat16, (16, 32)
    gate_up, gate_up_s = zip(*(quantize_fp8_blocks(torch.randn(2 * INTER, HIDDEN, generator=gen), block)
                               for _ in range(EXPERTS)))
    down, down_s = zip(*(quantize_fp8_blocks(torch.randn(HIDDEN, INTER, generator=gen), block)
                         for _ in range(EXPERTS)))
    gate_up, gate_up_s, down, down_s = map(torch.stack, (gate_up, gate_up_s, down, down_s))
    weights, ids = routing(7, 4, gen)
    x = (torch.randn(7, HIDDEN, generator=gen) / 8).to(dtype)
    want = fp8_experts_forward_torch(x, gate_up, gate_up_s, down, down_s, block, weights, ids)

    def dequantize(used):
        return (dequantize_fp8_experts(gate_up[used], gate_up_s[used], block, dtype),
                dequantize_fp8_experts(down[used], down_s[used], block, dtype))

    got = experts_in_chunks(x, weights, ids, dequantize, experts_forward_torch, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_chunk_size_follows_the_byte_budget_and_bad_sizes_are_refused():
    assert experts_per_chunk(88 << 20, 2 << 30) == 23
    assert experts_per_chunk(3 << 30, 2 << 30) == 1  # one expert always fits
    with pytest.raises(ValueError, match="bytes_per_expert and max_bytes must be positive"):
        experts_per_chunk(0)
    gen = torch.Generator().manual_seed(0)
    weights, ids = routing(2, 2, gen)
    with pytest.raises(ValueError, match="chunk_experts must be >= 1, got 0"):
        experts_in_chunks(torch.randn(2, HIDDEN), weights, ids, None, experts_forward_torch, 0)
