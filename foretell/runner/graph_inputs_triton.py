"""The one launch that scatters a packed step (runner/graph_inputs.py) into a CUDA graph's input
buffers. Twin: graph_inputs.unpack_torch. Imports triton: CUDA (or the interpreter tests) only."""

from __future__ import annotations

import triton
import triton.language as tl

from foretell.runner.graph_inputs import GraphInputBuffers, PackedLayout

BLOCK = 1024  # elements of each segment per program


# The sizes change from step to step. Triton would compile a variant for each new combination of
# them being 1, a multiple of 16 or neither: in a timed EAGLE3 run at batch 16 on the H200 one such
# compile stalled a step 140-250 ms when the batch first shrank to 13 (scripts/probe_spec_steps.py).
@triton.jit(do_not_specialize=["rows", "live_rows", "bucket", "table_cells", "width", "table_offset"])
def _unpack_kernel(
    staging_ptr,  # [size] int64, the packed step
    tokens_ptr,  # [live_rows] int64
    input_ids_ptr,  # int64 buffers
    positions_ptr,
    slot_mapping_ptr,
    seq_lens_ptr,  # int32 buffers
    query_start_loc_ptr,
    block_table_ptr,
    rows,
    live_rows,
    bucket,
    table_cells,  # live sequences x width
    width,
    stride_table,
    table_offset,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_rows = i < rows
    tl.store(positions_ptr + i, tl.load(staging_ptr + i, mask=in_rows), mask=in_rows)
    tl.store(slot_mapping_ptr + i, tl.load(staging_ptr + rows + i, mask=in_rows), mask=in_rows)
    live = i < live_rows
    tl.store(input_ids_ptr + i, tl.load(tokens_ptr + i, mask=live), mask=live)
    in_seqs = i < bucket
    seq_lens = tl.load(staging_ptr + 2 * rows + i, mask=in_seqs)
    tl.store(seq_lens_ptr + i, seq_lens.to(tl.int32), mask=in_seqs)
    in_starts = i <= bucket
    starts = tl.load(staging_ptr + 2 * rows + bucket + i, mask=in_starts)
    tl.store(query_start_loc_ptr + i, starts.to(tl.int32), mask=in_starts)
    in_table = i < table_cells
    blocks = tl.load(staging_ptr + table_offset + i, mask=in_table)
    tl.store(block_table_ptr + (i // width) * stride_table + i % width, blocks.to(tl.int32), mask=in_table)


def unpack_triton(staging, tokens, buffers: GraphInputBuffers, layout: PackedLayout) -> None:
    cells = layout.num_seqs * layout.width
    extent = max(layout.rows, layout.bucket + 1, cells)
    _unpack_kernel[(triton.cdiv(extent, BLOCK),)](
        staging, tokens, buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
        buffers.query_start_loc, buffers.block_table, layout.rows, layout.live_rows, layout.bucket, cells,
        layout.width, buffers.block_table.stride(0), layout.table_offset,
        BLOCK=BLOCK,
    )
