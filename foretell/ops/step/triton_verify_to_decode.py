"""One launch that turns a host drafter's verify step's graph inputs into the plain decode step's
after it (ops/step/verify_to_decode.py has what it computes and the torch twin). Imports triton:
CUDA (or the interpreter tests) only. Called on a drafting step's host path, so after the first
launch the compiled kernel is called through its launcher directly (ops/common/direct_launch.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from foretell.ops.common.direct_launch import launch_kept

BLOCK_SEQS = 128  # sequences per program (the graph buckets go up to max_num_seqs)


@triton.jit(do_not_specialize=["num_seqs", "bucket", "q", "stride_table", "block_size"])
def _verify_to_decode_kernel(
    input_ids_ptr,  # [>= bucket] int64 out
    positions_ptr,  # [>= bucket] int64 out
    slot_mapping_ptr,  # [>= bucket] int64 out
    seq_lens_ptr,  # [>= bucket] int32: read (live sequences), then written
    query_start_ptr,  # [>= bucket + 1] int32 out
    table_ptr,  # [>= num_seqs, W] int32 at (stride_table, 1)
    accepted_ptr,  # [>= num_seqs] int64
    next_token_ptr,  # [>= num_seqs] int64
    num_seqs,
    bucket,
    q,
    stride_table,
    block_size,
    BLOCK: tl.constexpr,
):
    seqs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = seqs < num_seqs
    in_graph = seqs < bucket
    context = tl.load(seq_lens_ptr + seqs, mask=live, other=0).to(tl.int64)
    pos = context - q + tl.load(accepted_ptr + seqs, mask=live, other=0) + 1  # int64
    pos = tl.where(live, pos, 0)
    block = tl.load(table_ptr + seqs.to(tl.int64) * stride_table + pos // block_size, mask=live, other=0)
    slot = tl.where(live, block.to(tl.int64) * block_size + pos % block_size, -1)
    tl.store(input_ids_ptr + seqs, tl.load(next_token_ptr + seqs, mask=live, other=0), mask=live)
    tl.store(positions_ptr + seqs, pos, mask=in_graph)
    tl.store(slot_mapping_ptr + seqs, slot, mask=in_graph)
    tl.store(seq_lens_ptr + seqs, (pos + 1).to(tl.int32), mask=in_graph)
    tl.store(query_start_ptr + seqs, seqs.to(tl.int32), mask=seqs <= bucket)


def verify_to_decode_inputs_triton(input_ids, positions, slot_mapping, seq_lens, query_start_loc, table, accepted,
                                   next_token, num_seqs: int, bucket: int, q: int, block_size: int,
                                   launches: dict | None = None) -> None:
    """The launch (every size marked not to specialize: the pointers' 16-byte alignment is the
    whole key of the kept compiled kernel)."""
    if table.stride(1) != 1:
        raise ValueError(f"the block table's rows must be contiguous, got strides {table.stride()}")
    grid = triton.cdiv(bucket + 1, BLOCK_SEQS)
    args = (input_ids, positions, slot_mapping, seq_lens, query_start_loc, table, accepted, next_token, num_seqs,
            bucket, q, table.stride(0), block_size)
    key = (input_ids.device.index, tuple(t.data_ptr() % 16 == 0 for t in args[:8]))
    launch_kept(_verify_to_decode_kernel, grid, args, BLOCK_SEQS, launches, key, input_ids.device,
                "verify-to-decode kernel")
