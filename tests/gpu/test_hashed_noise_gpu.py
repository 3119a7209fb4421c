"""The hashed-noise kernels on a CUDA device (ops/sampling/triton_hashed_noise.py): uniform and Exp(1)
noise at a real vocabulary equal, bit for bit, to the torch twin on CUDA and on the CPU; all 2**24
Exp(1) values through the compiled conversion (libdevice's float64 log) against the CPU twin; row
seeds; the fused race against the unfused path (argmax_rows of probs / noise: the Triton argmax) at
real vocabularies and 1 to 1024 rows; sample_padded's fused race against rejection_core with the
noise stored; the padded step's noise launches captured in a CUDA graph and replayed on new inputs.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from fixtures.seeds import reports_seed
from foretell.layers.sampler import (
    UNIFORM_STREAM,
    SamplingBatch,
    argmax_rows,
    hashed_exponential,
    hashed_uniform,
    processed_probs,
    row_seeds_on_device,
    sample_from_probs,
    sample_from_probs_seeded,
)
from foretell.ops.sampling import hashed_noise
from foretell.ops.sampling import triton_hashed_noise as kernels
from foretell.sampling_params import SamplingParams
from foretell.spec_decode.rejection_sampler import PaddedSampling, rejection_core, sample_padded

DEVICE = torch.device("cuda")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


def _seeds(count: int) -> torch.Tensor:
    return torch.tensor([0, 2**63 - 1] + [random.randrange(2**63) for _ in range(count - 2)], device=DEVICE)


@pytest.mark.parametrize("width", [128256, 151936, 5])
def test_noise_equals_the_twin_on_cuda_and_on_the_cpu(width):
    seeds = _seeds(64)
    exponential = kernels.hashed_exponential_triton(seeds, width)
    assert _bits_equal(exponential, hashed_noise.hashed_exponential_torch(seeds, width))
    assert _bits_equal(exponential, hashed_noise.hashed_exponential_torch(seeds.cpu(), width))
    assert _bits_equal(exponential, hashed_exponential(seeds, width))  # the dispatch takes the kernel
    uniform = kernels.hashed_uniform_triton(seeds, width, UNIFORM_STREAM)
    assert _bits_equal(uniform, hashed_noise.hashed_uniform_torch(seeds, width, UNIFORM_STREAM))
    assert _bits_equal(uniform, hashed_noise.hashed_uniform_torch(seeds.cpu(), width, UNIFORM_STREAM))
    assert _bits_equal(uniform, hashed_uniform(seeds, width, UNIFORM_STREAM))


@triton.jit
def _convert_kernel(bits_ptr, exponential_ptr, uniform_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offsets).to(tl.uint32)
    tl.store(exponential_ptr + offsets, kernels._exponential_of_bits(bits))
    tl.store(uniform_ptr + offsets, kernels._uniform_of_bits(bits))


def test_every_exponential_value_equals_the_cpu_twin():
    bits = (torch.arange(1 << 24, dtype=torch.int64) << 8) | 0x5A
    exponential = torch.empty(1 << 24, device=DEVICE)
    uniform = torch.empty(1 << 24, device=DEVICE)
    _convert_kernel[((1 << 24) // 1024,)](bits.to(DEVICE), exponential, uniform, BLOCK=1024)
    assert _bits_equal(exponential, hashed_noise.exponential_of_bits(bits))
    assert _bits_equal(exponential, hashed_noise.exponential_of_bits(bits.to(DEVICE)))  # torch's CUDA log
    assert _bits_equal(uniform, hashed_noise.uniform_of_bits(bits))


def test_row_seeds_equal_the_twin():
    keys = _seeds(16)
    positions = torch.randint(0, 2**40, (16, 5), device=DEVICE)
    assert torch.equal(row_seeds_on_device(keys, positions), hashed_noise.row_seeds_torch(keys.cpu(), positions.cpu()).to(DEVICE))


@pytest.mark.parametrize("vocab", [128256, 151936, 102400, 32000])
@pytest.mark.parametrize("rows", [1, 32, 1024])
def test_fused_race_equals_the_unfused_path(rows, vocab):
    seed = random.randrange(2**31)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen, device=DEVICE) * 3, dim=-1)
    probs[::3, vocab // 2 :] = 0.0  # truncated rows
    probs[1::5] = 0.0
    probs[1::5, 7] = 1.0  # one-hot rows
    seeds = _seeds(max(rows, 2))[:rows]
    with reports_seed(seed):
        fused = kernels.exponential_race_triton(probs, seeds)
        unfused = argmax_rows(probs / hashed_exponential(seeds, vocab))
        assert torch.equal(fused, unfused)
        assert torch.equal(sample_from_probs_seeded(probs, seeds), unfused)
        cpu = sample_from_probs(probs.cpu(), hashed_noise.hashed_exponential_torch(seeds.cpu(), vocab))
        assert torch.equal(fused.cpu(), cpu)  # IEEE division and argmax on the CPU: the same tokens


def test_sample_padded_equals_rejection_core_with_stored_noise():
    n, k, vocab = 6, 3, 128256
    gen = torch.Generator(device=DEVICE).manual_seed(random.randrange(2**31))
    logits = torch.randn(n, k + 1, vocab, generator=gen, device=DEVICE) * 2
    params = [SamplingParams(temperature=0.9, top_k=50 if i % 2 else 0, seed=i) for i in range(n)]
    sampling = SamplingBatch.build([p for p in params for _ in range(k + 1)], [None] * n * (k + 1), vocab, DEVICE)
    rows = PaddedSampling(sampling, torch.tensor([random.randrange(2**63) for _ in range(n)], device=DEVICE))
    drafts = logits[:, :k].argmax(-1)  # drafts the target likes, so that some are accepted
    drafts[::2, 1] = 5
    first_positions = torch.randint(0, 5000, (n,), device=DEVICE)
    lengths = torch.tensor([3, 2, 3, 0, 1, 3], device=DEVICE)
    accepted, next_token = sample_padded(logits, drafts, None, rows, first_positions, None, lengths)

    probs = processed_probs(logits.reshape(-1, vocab), sampling).view(n, k + 1, vocab)
    seeds = row_seeds_on_device(rows.keys, first_positions[:, None] + torch.arange(k + 1, device=DEVICE))
    uniform = hashed_uniform(seeds[:, 0], k, UNIFORM_STREAM)
    noise = hashed_exponential(seeds.reshape(-1), vocab).view(n, k + 1, vocab)
    q = torch.zeros(n, k, vocab, device=DEVICE).scatter_(-1, drafts[..., None], 1.0)
    want_accepted, choice = rejection_core(probs, drafts, q, lengths, uniform, noise)
    assert torch.equal(accepted, want_accepted)
    assert torch.equal(next_token, choice.gather(1, want_accepted[:, None]).squeeze(1))


def test_noise_launches_replay_in_a_cuda_graph():
    n, q_rows, vocab = 8, 4, 128256
    keys = _seeds(n)
    first_positions = torch.randint(0, 1000, (n,), device=DEVICE)
    probs = torch.softmax(torch.randn(n * q_rows, vocab, device=DEVICE), dim=-1)
    offsets = torch.arange(q_rows, device=DEVICE)

    def step():
        seeds = row_seeds_on_device(keys, first_positions[:, None] + offsets[None, :])
        return hashed_uniform(seeds[:, 0], q_rows - 1, UNIFORM_STREAM), sample_from_probs_seeded(probs, seeds.reshape(-1))

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        uniform_out, tokens_out = step()
    for _ in range(3):
        probs.copy_(torch.softmax(torch.randn_like(probs) * 2, dim=-1))
        first_positions.add_(q_rows)
        graph.replay()
        uniform, tokens = step()
        assert _bits_equal(uniform_out, uniform) and torch.equal(tokens_out, tokens)
