"""Counter-based noise: the dispatch between the torch twin (hashed_noise_reference.py, whose names
this module re-exports) and the Triton kernels (triton_hashed_noise.py) on CUDA.

What the noise is (row seeds, the hash, the uniform and Exp(1) draws, why they are the same bits on
every device) is said in hashed_noise_reference.py. The dispatch adds only the argument checks.
"""

from __future__ import annotations

import torch

from foretell.ops.common import kernel_choice
from foretell.ops.sampling.hashed_noise_reference import (  # noqa: F401  (the twin's names, re-exported)
    MASK32,
    MASK31,
    HASH_MULTIPLIER,
    EXPONENTIAL_STREAM,
    UNIFORM_STREAM,
    POSITION_SALT,
    KEY_SALT,
    UNIFORM_BITS,
    EXPONENTIAL_BITS,
    mix32,
    seed_at_position,
    hashed_bits_torch,
    row_seeds_torch,
    uniform_of_bits,
    exponential_of_bits,
    hashed_uniform_torch,
    hashed_exponential_torch,
)


def _check_seeds(seeds: torch.Tensor, width: int) -> None:
    if seeds.dim() != 1 or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be a [rows] int64 tensor of row seeds, got {list(seeds.shape)} {seeds.dtype}")
    if width < 0:
        raise ValueError(f"width must be >= 0 (columns of noise per row), got {width}")


def row_seeds(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys [n] int64 (sequence keys), positions [n, r] int64 -> row seeds [n, r] int64; one
    launch on CUDA instead of some thirty small torch ops."""
    if keys.dim() != 1 or positions.dim() != 2 or positions.shape[0] != keys.shape[0] \
            or keys.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"row_seeds needs keys [n] int64 and positions [n, r] int64, got "
                         f"{list(keys.shape)} {keys.dtype} and {list(positions.shape)} {positions.dtype}")
    if kernel_choice.use_triton(keys, positions):
        from foretell.ops.sampling import triton_hashed_noise  # imports triton: CUDA only

        return triton_hashed_noise.row_seeds_triton(keys, positions)
    return row_seeds_torch(keys, positions)


def hashed_uniform(seeds: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """Counter-based U(0, 1) draws: seeds [rows] int64 (63-bit row seeds) -> [rows, width] float32,
    value (r, c) a function of (seeds[r], stream, c) with 23 random bits, never 0 or 1; one kernel
    on CUDA, bit for bit the torch twin's."""
    _check_seeds(seeds, width)
    if kernel_choice.use_triton(seeds):
        from foretell.ops.sampling import triton_hashed_noise

        return triton_hashed_noise.hashed_uniform_triton(seeds, width, stream)
    return hashed_uniform_torch(seeds, width, stream)


def hashed_exponential(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """Counter-based Exp(1) draws [rows, width] float32 (the exponential race's noise); one kernel
    on CUDA, bit for bit the torch twin's."""
    _check_seeds(seeds, width)
    if kernel_choice.use_triton(seeds):
        from foretell.ops.sampling import triton_hashed_noise

        return triton_hashed_noise.hashed_exponential_triton(seeds, width)
    return hashed_exponential_torch(seeds, width)
