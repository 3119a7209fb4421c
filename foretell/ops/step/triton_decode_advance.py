"""One launch that turns a decode step's graph inputs into the next one's (ops/step/decode_advance.py
has what it computes and the torch twin). Imports triton: CUDA (or the interpreter tests) only.

This launch is the whole host-to-device traffic of a queued greedy decode step that it serves, so
its host cost matters as much as its device time: after the first launch of a runner the compiled
kernel is kept and called through its launcher directly (ops/common/direct_launch.py, as the graph
inputs' unpack does), skipping Triton's argument binding and cache lookup.
"""

from __future__ import annotations

import triton
import triton.language as tl

from foretell.ops.common.direct_launch import launch_kept

BLOCK_SEQS = 128  # sequences per program (the graph buckets go up to max_num_seqs)


@triton.jit(do_not_specialize=["num_seqs", "stride_table", "block_size"])
def _advance_decode_kernel(
    input_ids_ptr,  # [>= B] int64 out
    positions_ptr,  # [>= B] int64: read, then written
    slot_mapping_ptr,  # [>= B] int64 out
    seq_lens_ptr,  # [>= B] int32 out
    table_ptr,  # [B, W] int32 at (stride_table, 1)
    tokens_ptr,  # [B] int64
    num_seqs,
    stride_table,
    block_size,
    BLOCK: tl.constexpr,
):
    seqs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = seqs < num_seqs
    pos = tl.load(positions_ptr + seqs, mask=live, other=0) + 1  # int64
    block = tl.load(table_ptr + seqs.to(tl.int64) * stride_table + pos // block_size, mask=live, other=0)
    tl.store(slot_mapping_ptr + seqs, block.to(tl.int64) * block_size + pos % block_size, mask=live)
    tl.store(seq_lens_ptr + seqs, (pos + 1).to(tl.int32), mask=live)
    tl.store(input_ids_ptr + seqs, tl.load(tokens_ptr + seqs, mask=live, other=0), mask=live)
    tl.store(positions_ptr + seqs, pos, mask=live)


def advance_decode_inputs_triton(input_ids, positions, slot_mapping, seq_lens, table, tokens, block_size: int,
                                 launches: dict | None = None) -> None:
    """The launch. With `launches` (a dict its caller keeps, one per CudaGraphRunner) the compiled
    kernel of the first launch is kept there and later ones call its launcher directly. Every size
    is marked not to specialize, so the pointers' 16-byte alignment is the whole key; a driver
    launch hook (a profiler) takes the normal path."""
    num_seqs = tokens.shape[0]
    if num_seqs == 0:
        return
    if table.stride(1) != 1:
        raise ValueError(f"the block table's rows must be contiguous, got strides {table.stride()}")
    grid = triton.cdiv(num_seqs, BLOCK_SEQS)
    args = (input_ids, positions, slot_mapping, seq_lens, table, tokens, num_seqs, table.stride(0), block_size)
    key = (input_ids.device.index, tuple(t.data_ptr() % 16 == 0 for t in args[:6]))
    launch_kept(_advance_decode_kernel, grid, args, BLOCK_SEQS, launches, key, input_ids.device,
                "decode advance kernel")
