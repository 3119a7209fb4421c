"""Counter-based noise in torch (the twin that the Triton kernels of triton_hashed_noise.py equal bit
for bit): the hash of (row seed, stream, column) and the draws made from it. hashed_noise.py
dispatches between the two.

A row seed is a 63-bit int (layers/sampler.py derives it from a request's seed, its sample index and
a token position; seed_at_position is the part the padded step computes on the device). Column c of
a row's stream s is 32 hash bits; they become
  - a U(0, 1) draw (hashed_uniform): ((bits >> 9) + 0.5) / 2**23 in float32, exact, never 0 or 1;
  - an Exp(1) draw (hashed_exponential): -ln(((bits >> 8) + 0.5) / 2**24) computed in float64 and
    rounded to float32. Each of the 2**24 values' exact logarithm lies at least 19 float64 ulps
    from a float32 rounding boundary (checked over all of them, tests/ops/test_hashed_noise_triton.py),
    so any float64 log within 19 ulps (torch on CPU and CUDA, numpy, CUDA's libdevice: <= 1 ulp)
    gives the same float32: the noise is the same bits on every device and in every kernel.
    (A float32 log would not be: torch's CPU log and numpy's differ on a fifth of these inputs.)

All of it is integer arithmetic that stays below 2**63 and exact float conversions: capturable
(fixed shapes, no host reads) and equal wherever the same seeds are drawn.
"""

from __future__ import annotations

import torch


MASK32 = 0xFFFFFFFF
MASK31 = 0x7FFFFFFF
HASH_MULTIPLIER = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**59 (no int64 overflow)
# Streams of counter-based noise: a row's exponential draws (the race) and its uniform draws (accept
# tests) must not share values.
EXPONENTIAL_STREAM = 0x2F6B1C3D
UNIFORM_STREAM = 0x5DEECE66
POSITION_SALT = 0x9E3779B9
KEY_SALT = 0x85EBCA6B
UNIFORM_BITS = 23  # float32 holds (b + 0.5) exactly only for b < 2**23
EXPONENTIAL_BITS = 24  # made in float64, where (b + 0.5) / 2**24 is exact


def mix32(x):
    """A 32-bit integer hash (int in [0, 2**32), or an int64 tensor of such values): the same
    arithmetic on Python ints and on tensors, none of it overflowing int64."""
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    x = ((x >> 16) ^ x) * HASH_MULTIPLIER & MASK32
    return (x >> 16) ^ x


def seed_at_position(key, position):
    """A 63-bit row seed from a sequence's key and a token position (ints, or int64 tensors that
    broadcast): the same arithmetic on the host and on the device."""
    low = mix32((key & MASK32) ^ mix32((position & MASK32) ^ POSITION_SALT))
    high = mix32(((key >> 32) & MASK31) ^ mix32(low ^ KEY_SALT))
    return ((high & MASK31) << 32) | low


def hashed_bits_torch(seeds: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """seeds [rows] int64 (63-bit row seeds) -> [rows, width] int64 in [0, 2**32): the hash of
    (seeds[r], stream, c) at (r, c)."""
    low = mix32((seeds & MASK32) ^ stream)[:, None]  # [rows, 1]
    high = ((seeds >> 32) & MASK31)[:, None]  # [rows, 1]
    columns = torch.arange(width, dtype=torch.int64, device=seeds.device)[None, :]  # [1, width]
    return mix32((mix32(columns ^ low) + high) & MASK32)  # [rows, width]


def row_seeds_torch(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys [n] int64, positions [n, r] int64 -> [n, r] int64: seed_at_position(keys[i], positions[i, j])."""
    return seed_at_position(keys[:, None], positions)


def uniform_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash bits in [0, 2**32) -> float32 U(0, 1): ((bits >> 9) + 0.5) / 2**23, exact."""
    return ((bits >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def exponential_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash bits in [0, 2**32) -> float32 Exp(1): -ln(((bits >> 8) + 0.5) / 2**24) in float64,
    rounded to float32 (in (0, 17.33], never 0)."""
    uniform = ((bits >> (32 - EXPONENTIAL_BITS)).to(torch.float64) + 0.5) * (1.0 / (1 << EXPONENTIAL_BITS))
    return uniform.log_().neg_().to(torch.float32)


def hashed_uniform_torch(seeds: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """seeds [rows] int64 -> [rows, width] float32 U(0, 1) draws with 23 random bits."""
    return uniform_of_bits(hashed_bits_torch(seeds, width, stream))


def hashed_exponential_torch(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """seeds [rows] int64 -> [rows, width] float32 Exp(1) draws (the EXPONENTIAL_STREAM's)."""
    return exponential_of_bits(hashed_bits_torch(seeds, width, EXPONENTIAL_STREAM))
