"""Triton kernels for counter-based noise (twins: hashed_noise_reference.py's *_torch functions, bit for bit).

  - row seeds from sequence keys and positions (seed_at_position), one launch;
  - the noise itself, uniform or Exp(1), grid (rows, column blocks): the hash is done in uint32,
    where wrapping multiplication and addition are the torch twin's `& 0xFFFFFFFF` on int64;
  - the exponential race, argmax of probs / Exp(1) noise, without the [rows, vocab] noise tensor:
    grid (rows, chunks) finds each chunk's maximum of the quotients and the first column holding it,
    then triton_argmax's second kernel picks the first chunk with the row's maximum. The quotient is
    an IEEE division (div_rn: Triton's plain `/` on float32 is not correctly rounded), the noise the
    same bits as hashed_exponential's, NaN counts as +inf and the first column wins ties: exactly
    argmax_rows(probs / hashed_exponential(seeds, vocab)) on CUDA at triton_argmax's vocabularies.

Grids depend only on shapes and nothing is read back on the host, so every launch can be captured in
a CUDA graph. tests/ops/test_hashed_noise_triton.py holds kernels and twins together in Triton's
interpreter; tests/gpu/test_hashed_noise_gpu.py on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled
from foretell.ops.sampling import hashed_noise_reference as twin
from foretell.ops.sampling.triton_argmax import _pick_chunk_kernel

# The twin's constants, as the compile-time values kernels may read.
EXPONENTIAL_SHIFT = tl.constexpr(32 - twin.EXPONENTIAL_BITS)  # keep the top EXPONENTIAL_BITS bits
EXPONENTIAL_SCALE = tl.constexpr(1.0 / (1 << twin.EXPONENTIAL_BITS))
EXPONENTIAL_STREAM = tl.constexpr(twin.EXPONENTIAL_STREAM)
HASH_MULTIPLIER = tl.constexpr(twin.HASH_MULTIPLIER)
KEY_SALT = tl.constexpr(twin.KEY_SALT)
MASK31 = tl.constexpr(twin.MASK31)
POSITION_SALT = tl.constexpr(twin.POSITION_SALT)
UNIFORM_SHIFT = tl.constexpr(32 - twin.UNIFORM_BITS)
UNIFORM_SCALE = tl.constexpr(1.0 / (1 << twin.UNIFORM_BITS))
NOISE_BLOCK = 1024  # columns per program of the noise kernel
RACE_CHUNK = 4096  # columns per program of the race's first kernel


@triton.jit
def _mix32(x):
    """mix32 on uint32: multiplication wraps modulo 2**32, as the twin's masked int64 product."""
    multiplier = tl.full(x.shape, HASH_MULTIPLIER, tl.uint32)
    x = ((x >> 16) ^ x) * multiplier
    x = ((x >> 16) ^ x) * multiplier
    return (x >> 16) ^ x


@triton.jit
def _seed_parts(seed):
    """An int64 row seed -> (its low 32 bits, its bits 32..62) as uint32."""
    low = seed.to(tl.uint32)  # truncation: seed & 0xFFFFFFFF
    high = (seed >> 32).to(tl.uint32) & MASK31
    return low, high


@triton.jit
def _stream_bits(seed_low, seed_high, columns, stream):
    """32 hash bits (uint32) of (seed, stream, column) for uint32 columns: hashed_bits_torch."""
    low = _mix32(seed_low ^ stream)
    return _mix32(_mix32(columns ^ low) + seed_high)


@triton.jit
def _exponential_of_bits(bits):
    """-ln(((bits >> 8) + 0.5) / 2**24) in float64, rounded to float32: twin.exponential_of_bits."""
    uniform = ((bits >> EXPONENTIAL_SHIFT).to(tl.float64) + 0.5) * EXPONENTIAL_SCALE  # exact in float64
    return (-tl.log(uniform)).to(tl.float32)  # float64 log: libdevice's __nv_log on CUDA


@triton.jit
def _uniform_of_bits(bits):
    """((bits >> 9) + 0.5) / 2**23 in float32, exact: twin.uniform_of_bits."""
    return ((bits >> UNIFORM_SHIFT).to(tl.float32) + 0.5) * UNIFORM_SCALE


@triton.jit
def _row_seeds_kernel(
    keys_ptr,  # [n] int64
    positions_ptr,  # [n, r] int64
    out_ptr,  # [n, r] int64 out, contiguous
    r,
    stride_positions,
    R_P: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)
    i = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, R_P)
    valid = j < r
    key = tl.load(keys_ptr + i)
    position = tl.load(positions_ptr + i * stride_positions + j, mask=valid, other=0)
    key_low, key_high = _seed_parts(key)
    low = _mix32(key_low ^ _mix32(position.to(tl.uint32) ^ POSITION_SALT))
    high = _mix32(key_high ^ _mix32(low ^ KEY_SALT))
    seed = ((high & MASK31).to(tl.int64) << 32) | low.to(tl.int64)
    tl.store(out_ptr + i * r + j, seed, mask=valid)


@triton.jit
def _hashed_noise_kernel(
    seeds_ptr,  # [rows] int64, stride_seeds apart
    out_ptr,  # [rows, width] float32 out, contiguous
    width,
    stride_seeds,
    stream,
    EXPONENTIAL: tl.constexpr,  # Exp(1) draws; else U(0, 1)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # the seeds come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed_low, seed_high = _seed_parts(tl.load(seeds_ptr + row * stride_seeds))
    bits = _stream_bits(seed_low, seed_high, columns.to(tl.uint32), stream.to(tl.uint32))
    if EXPONENTIAL:
        values = _exponential_of_bits(bits)
    else:
        values = _uniform_of_bits(bits)
    tl.store(out_ptr + row * width + columns, values, mask=columns < width)


@triton.jit
def _race_chunk_kernel(
    probs_ptr,  # [rows, vocab] float32
    seeds_ptr,  # [rows] int64, stride_seeds apart
    chunk_max_ptr,  # [rows, num_chunks] float32 out
    chunk_arg_ptr,  # [rows, num_chunks] int32 out: a column of the row
    vocab,
    num_chunks,
    stride_probs,
    stride_seeds,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # the probabilities come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = columns < vocab
    probs = tl.load(probs_ptr + row * stride_probs + columns, mask=inside, other=0.0).to(tl.float32)
    seed_low, seed_high = _seed_parts(tl.load(seeds_ptr + row * stride_seeds))
    bits = _stream_bits(seed_low, seed_high, columns.to(tl.uint32), tl.full((), EXPONENTIAL_STREAM, tl.uint32))
    keys = tl.math.div_rn(probs, _exponential_of_bits(bits))
    keys = tl.where(keys != keys, float("inf"), keys)  # NaN -> +inf, as triton_argmax
    keys = tl.where(inside, keys, float("-inf"))
    best = tl.max(keys, axis=0)
    first = tl.min(tl.where(keys == best, columns, vocab), axis=0)  # first column holding best
    tl.store(chunk_max_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_arg_ptr + row * num_chunks + chunk, first)


def _check_seeds(seeds: torch.Tensor, device: torch.device) -> None:
    if seeds.dim() != 1 or seeds.dtype != torch.int64 or seeds.device != device:
        raise ValueError(f"seeds must be a [rows] int64 tensor on {device}, got {list(seeds.shape)} "
                         f"{seeds.dtype} on {seeds.device}")


def row_seeds_triton(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys [n] int64, positions [n, r] int64 (unit stride on r) -> [n, r] int64: row_seeds_torch."""
    n, r = positions.shape
    if positions.stride(1) != 1 and r > 1:
        positions = positions.contiguous()
    keys = keys.contiguous()
    out = torch.empty(n, r, dtype=torch.int64, device=positions.device)
    if n == 0 or r == 0:
        return out
    pdl = pdl_enabled(positions)
    _row_seeds_kernel[(n,)](keys, positions, out, r, positions.stride(0), R_P=max(2, triton.next_power_of_2(r)),
                            PDL=pdl, num_warps=1, **launch_options(pdl))
    return out


def _hashed_noise(seeds: torch.Tensor, width: int, stream: int, exponential: bool) -> torch.Tensor:
    _check_seeds(seeds, seeds.device)
    if not 0 <= stream < 2**31:
        raise ValueError(f"stream must be in [0, 2**31) for the Triton noise kernel, got {stream:#x}")
    out = torch.empty(seeds.shape[0], width, dtype=torch.float32, device=seeds.device)
    if out.numel() == 0:
        return out
    pdl = pdl_enabled(seeds)
    _hashed_noise_kernel[(seeds.shape[0], triton.cdiv(width, NOISE_BLOCK))](
        seeds, out, width, seeds.stride(0), stream, EXPONENTIAL=exponential, BLOCK=NOISE_BLOCK, PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )
    return out


def hashed_uniform_triton(seeds: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """seeds [rows] int64 -> [rows, width] float32: hashed_uniform_torch, bit for bit."""
    return _hashed_noise(seeds, width, stream, exponential=False)


def hashed_exponential_triton(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """seeds [rows] int64 -> [rows, width] float32: hashed_exponential_torch, bit for bit."""
    return _hashed_noise(seeds, width, twin.EXPONENTIAL_STREAM, exponential=True)


def exponential_race_triton(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] float32 (unit stride on vocab), seeds [rows] int64 -> [rows] int64: the
    first column of each row's maximum of probs / hashed_exponential(seeds, vocab), NaN counting as
    +inf (triton_argmax's rule); the noise is never stored."""
    if probs.dim() != 2 or probs.shape[-1] == 0 or probs.stride(-1) != 1 or probs.dtype != torch.float32:
        raise ValueError(f"exponential_race_triton needs float32 probs [rows, vocab > 0] with a unit last "
                         f"stride; got {probs.dtype} shape {tuple(probs.shape)}, stride {probs.stride()}")
    _check_seeds(seeds, probs.device)
    if seeds.shape[0] != probs.shape[0]:
        raise ValueError(f"one seed per probs row: {probs.shape[0]} rows, {seeds.shape[0]} seeds")
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, RACE_CHUNK)
    pdl = pdl_enabled(probs)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=probs.device)
    chunk_arg = torch.empty(rows, num_chunks, dtype=torch.int32, device=probs.device)
    _race_chunk_kernel[(rows, num_chunks)](
        probs, seeds, chunk_max, chunk_arg, vocab, num_chunks, probs.stride(0), seeds.stride(0),
        CHUNK=RACE_CHUNK, PDL=pdl, num_warps=8, **launch_options(pdl),
    )
    _pick_chunk_kernel[(rows,)](
        chunk_max, chunk_arg, out, out, num_chunks, out.stride(0),
        CHUNKS_P=max(2, triton.next_power_of_2(num_chunks)), HAS_MAP=False, PDL=pdl, num_warps=1,
        **launch_options(pdl),
    )
    return out
