"""The counter-based noise kernels (ops/sampling/triton_hashed_noise.py) against their torch twins
(ops/sampling/hashed_noise.py), bit for bit, in Triton's interpreter on CPU tensors (the real kernels
on a CUDA machine): row seeds from keys and positions (positions past 2**32, strided); uniform and
Exp(1) noise at widths of one column, one block, a ragged last block; seeds at 0 and 2**63 - 1, a
strided seed column; the fused exponential race against triton_argmax over probs / noise (one-hot
rows, zeros, ties of the quotient, NaN, a ragged last chunk); every one of the 2**24 Exp(1) values
and 2**23 uniforms through the kernels' float conversion; bad input. Also the conversion's proof:
each Exp(1) value's float64 logarithm is far from a float32 rounding boundary, and the old float32
uniform's bias (a value of 1.0, hence Exp(1) = 0, which won the race at p = 0) is gone.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fixtures.seeds import reports_seed
from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_env, interpreter_mode  # noqa: F401
from foretell.layers.sampler import row_seed, sample_from_probs, sequence_key
from foretell.ops.sampling import hashed_noise

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernels = import_interpreted("foretell.ops.sampling.triton_hashed_noise")
argmax_kernels = import_interpreted("foretell.ops.sampling.triton_argmax")
BLOCK, CHUNK = kernels.NOISE_BLOCK, kernels.RACE_CHUNK
EDGE_SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


def _seeds(count: int, gen: torch.Generator) -> torch.Tensor:
    random_seeds = torch.randint(0, 2**63 - 1, (count,), generator=gen).tolist()
    return torch.tensor(EDGE_SEEDS + random_seeds, dtype=torch.int64)


@pytest.mark.parametrize("width", [1, 7, BLOCK, BLOCK + 37])
def test_noise_matches_the_torch_twin_bit_for_bit(width):
    seed = random.randrange(2**31)
    seeds = _seeds(4, torch.Generator().manual_seed(seed))
    with reports_seed(seed):
        for stream in (hashed_noise.UNIFORM_STREAM, hashed_noise.EXPONENTIAL_STREAM, 0):
            got = kernels.hashed_uniform_triton(seeds.to(DEVICE), width, stream)
            assert _bits_equal(got, hashed_noise.hashed_uniform_torch(seeds, width, stream))
        got = kernels.hashed_exponential_triton(seeds.to(DEVICE), width)
        assert _bits_equal(got, hashed_noise.hashed_exponential_torch(seeds, width))


def test_strided_seeds_and_empty_shapes():
    table = torch.randint(0, 2**62, (5, 3))  # a padded step's [n, k + 1] seeds; its column 0
    got = kernels.hashed_uniform_triton(table[:, 0].to(DEVICE), 9, hashed_noise.UNIFORM_STREAM)
    assert _bits_equal(got, hashed_noise.hashed_uniform_torch(table[:, 0].contiguous(), 9, hashed_noise.UNIFORM_STREAM))
    assert kernels.hashed_exponential_triton(table[:, 0].to(DEVICE), 0).shape == (5, 0)
    assert kernels.hashed_exponential_triton(torch.empty(0, dtype=torch.int64, device=DEVICE), 10).shape == (0, 10)


def test_row_seeds_match_the_twin_and_the_host():
    keys = [sequence_key(random.randrange(2**40), random.randrange(4)) for _ in range(6)] + [0, 2**63 - 1]
    positions = [[random.randrange(2**40) for _ in range(5)] for _ in keys]  # past 2**32: only the low bits count
    keys_t, positions_t = torch.tensor(keys), torch.tensor(positions)
    got = kernels.row_seeds_triton(keys_t.to(DEVICE), positions_t.to(DEVICE)).cpu()
    assert torch.equal(got, hashed_noise.row_seeds_torch(keys_t, positions_t))
    assert got.tolist() == [[hashed_noise.seed_at_position(k, p) for p in ps] for k, ps in zip(keys, positions)]
    base = torch.randint(0, 10**6, (8, 7))
    for view in (base[:, 2:3], torch.randint(0, 10**6, (7, 8)).t()[:, :3], base[:, ::2]):  # one column, transposed, strided
        assert torch.equal(kernels.row_seeds_triton(keys_t.to(DEVICE), view.to(DEVICE)).cpu(),
                           hashed_noise.row_seeds_torch(keys_t, view))
    assert kernels.row_seeds_triton(keys_t.to(DEVICE), torch.empty(8, 0, dtype=torch.int64, device=DEVICE)).shape == (8, 0)
    seed = 123
    assert hashed_noise.row_seeds(torch.tensor([sequence_key(seed, 0)]), torch.tensor([[40]])).item() == row_seed(seed, 0, 40)


def _unfused_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The unfused race as CUDA runs it at large vocabularies: triton_argmax over probs / noise."""
    noise = hashed_noise.hashed_exponential_torch(seeds.cpu(), probs.shape[-1]).to(probs.device)
    return argmax_kernels.argmax_triton(probs / noise)


@pytest.mark.parametrize("vocab", [100, CHUNK, 2 * CHUNK + 37])
def test_fused_race_equals_argmax_over_probs_and_noise(vocab):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    seeds = _seeds(3, gen)  # 8 rows
    probs = torch.softmax(torch.randn(len(seeds), vocab, generator=gen) * 3, dim=-1)
    probs[1] = 0.0
    probs[1, vocab - 1] = 1.0  # one-hot on the last column
    probs[2, : vocab // 2] = 0.0  # half the vocabulary cut (top-k like)
    probs[3] = 0.0  # nothing but zeros: every quotient 0, the first column
    probs[4, 5] = float("nan")  # NaN counts as +inf, as triton_argmax's
    with reports_seed(seed):
        got = kernels.exponential_race_triton(probs.to(DEVICE), seeds.to(DEVICE)).cpu()
        assert torch.equal(got, _unfused_race(probs.to(DEVICE), seeds.to(DEVICE)).cpu())
        assert got[1] == vocab - 1 and got[3] == 0 and got[4] == 5
        finite = [0, 2, 5, 6, 7]  # rows without NaN: torch.argmax agrees too (the CPU's sample_from_probs)
        noise = hashed_noise.hashed_exponential_torch(seeds, vocab)
        assert torch.equal(got[finite], sample_from_probs(probs, noise)[finite])


def test_fused_race_ties_take_the_first_column():
    # Two columns with the same Exp(1) draw and the same probability tie in probs / noise.
    seeds = torch.tensor([sequence_key(5, 0)])
    vocab = 3 * CHUNK
    noise = hashed_noise.hashed_exponential_torch(seeds, vocab)[0]
    values, counts = torch.unique(noise, return_counts=True)
    assert bool((counts > 1).any())  # ~4.5 equal pairs expected among 12288 draws of 2**24 values
    twins = (noise == values[counts > 1][0]).nonzero().flatten()[:2]  # two columns with equal draws
    probs = torch.zeros(1, vocab)
    probs[0, twins] = 0.5
    got = kernels.exponential_race_triton(probs.to(DEVICE), seeds.to(DEVICE)).cpu()
    first = twins.min().item()
    assert got.tolist() == [first] == _unfused_race(probs, seeds).tolist() == (probs / noise).argmax(-1).tolist()


def test_every_value_of_the_float_conversion():
    """All 2**24 Exp(1) values and 2**23 uniforms through the kernels' conversion, against the twin
    (so the interpreter's numpy log agrees with torch's on every one of them)."""
    with interpreter_env():
        import triton
        import triton.language as tl

        @triton.jit
        def convert(bits_ptr, exponential_ptr, uniform_ptr, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            bits = tl.load(bits_ptr + offsets).to(tl.uint32)
            tl.store(exponential_ptr + offsets, kernels._exponential_of_bits(bits))
            tl.store(uniform_ptr + offsets, kernels._uniform_of_bits(bits))

        bits = (torch.arange(1 << 24, dtype=torch.int64) << 8) | 0xA5  # every top-24-bit value, low bits set
        exponential = torch.empty(1 << 24, device=DEVICE)
        uniform = torch.empty(1 << 24, device=DEVICE)
        convert[((1 << 24) // (1 << 18),)](bits.to(DEVICE), exponential, uniform, BLOCK=1 << 18)
    assert _bits_equal(exponential, hashed_noise.exponential_of_bits(bits))
    assert _bits_equal(uniform, hashed_noise.uniform_of_bits(bits))
    assert float(exponential.min()) > 0 and float(exponential.max()) < 17.4
    assert 0 < float(uniform.min()) and float(uniform.max()) < 1


def test_float64_log_is_far_from_every_float32_rounding_boundary():
    """Why any float64 log gives the same Exp(1) bits: each value's logarithm (torch's, within half
    a float64 ulp) is at least 19 float64 ulps from the middle between two float32 neighbours, so any
    log within a few ulps (CUDA's libdevice, numpy, glibc: <= 1) rounds to the same float32."""
    u = (torch.arange(1 << 24, dtype=torch.float64) + 0.5) * 2.0**-24
    e64 = -torch.log(u)
    e32 = e64.to(torch.float32)
    above = torch.nextafter(e32, torch.tensor(float("inf"))).double()
    below = torch.nextafter(e32, torch.tensor(0.0)).double()
    ulp64 = torch.nextafter(e64, torch.tensor(float("inf"), dtype=torch.float64)) - e64
    to_boundary = torch.minimum(((e32.double() + above) / 2 - e64).abs(), (e64 - (e32.double() + below) / 2).abs())
    assert float((to_boundary / ulp64).min()) >= 19
    numpy_e32 = (-np.log(u.numpy())).astype(np.float32)  # another log implementation: the same bits
    assert np.array_equal(numpy_e32.view(np.int32), e32.numpy().view(np.int32))


def test_no_exponential_draw_is_zero_where_the_old_uniform_was_one():
    # With the float32 uniform ((b >> 8) + 0.5) / 2**24 this seed's column 106019 was 1.0: Exp(1) = 0,
    # and the race chose the column even at p = 0.
    seeds, column = torch.tensor([1192276]), 106019
    bits = hashed_noise.hashed_bits_torch(seeds, column + 1, hashed_noise.EXPONENTIAL_STREAM)[0, column]
    assert int(bits) >> 8 == (1 << 24) - 1
    noise = hashed_noise.hashed_exponential_torch(seeds, column + 1)
    assert float(noise[0, column]) > 0
    probs = torch.zeros(1, column + 1)
    probs[0, 5] = 1.0
    assert sample_from_probs(probs, noise).item() == 5


def test_bad_input_is_named():
    seeds = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="int64"):
        hashed_noise.hashed_uniform(seeds.to(torch.int32), 4, 0)
    with pytest.raises(ValueError, match=r"\[rows\]"):
        hashed_noise.hashed_exponential(seeds[None], 4)
    with pytest.raises(ValueError, match="width"):
        hashed_noise.hashed_exponential(seeds, -1)
    with pytest.raises(ValueError, match="positions"):
        hashed_noise.row_seeds(seeds, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="stream"):
        kernels.hashed_uniform_triton(seeds.to(DEVICE), 4, 2**31)
    with pytest.raises(ValueError, match="float32 probs"):
        kernels.exponential_race_triton(torch.ones(2, 8, dtype=torch.float16, device=DEVICE), seeds.to(DEVICE))
    with pytest.raises(ValueError, match="unit last"):
        kernels.exponential_race_triton(torch.ones(8, 2, device=DEVICE).t(), seeds.to(DEVICE))
    with pytest.raises(ValueError, match="one seed per probs row"):
        kernels.exponential_race_triton(torch.ones(3, 8, device=DEVICE), seeds.to(DEVICE))
