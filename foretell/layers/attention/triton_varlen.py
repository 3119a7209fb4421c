"""Device-side helpers shared by the varlen Triton attention kernels (GQA and MLA)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence that owns program q_block when sequence i's query blocks start at
    query_start_loc[i] // BLOCK_Q + i (so no host sync is needed to build the grid): the last i
    with that start <= q_block, by binary search."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_block <= q_block, mid, lo)
        hi = tl.where(first_block <= q_block, hi, mid)
    return lo
