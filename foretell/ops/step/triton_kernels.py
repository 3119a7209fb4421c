"""One launch for each piece of a speculative step's bookkeeping (reference.py has the torch twins
and the shapes; dispatch.py chooses): the unpack of a packed step into a CUDA graph's input
buffers, greedy and drawn acceptance, the draft loop's catch-up inputs, the next verify step's
inputs. Imports triton: CUDA (or the interpreter tests) only.

The sizes change from step to step. Triton would compile a variant for each new combination of
them being 1, a multiple of 16 or neither: in a timed EAGLE3 run at batch 16 on the H200 one such
compile stalled a step when the batch first shrank to 13 (docs/perf-log.md), and under adaptive
speculation the next verify's inputs compiled once more when a batch's block-table width first
reached 16 (tests/gpu/test_no_compiles_after_warm_up_gpu.py). So neither the counts nor the strides
and block sizes are specialized on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.common.direct_launch import launch_kept
from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled
from foretell.ops.step.inputs import CatchUpInputs, ChainStepInputs, GraphInputBuffers, PackedLayout

BLOCK_SEQS = 64  # sequences per program (the graph buckets go up to max_num_seqs)
UNPACK_BLOCK = 1024  # elements of each segment per program


def _pdl(t: torch.Tensor) -> dict:
    """PDL's constexpr and launch option (ops/common/pdl.py): each of these launches right behind the
    kernel before it and waits for it first, so the chain of small launches between two graphs'
    weight streams pays less of each launch's latency."""
    pdl = pdl_enabled(t)
    return {"PDL": pdl, **launch_options(pdl)}


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


def unpack_graph_inputs_triton(staging, tokens, buffers: GraphInputBuffers, layout: PackedLayout,
                               launches: dict | None = None) -> None:
    """The unpack's launch. With `launches` (a dict its caller keeps, e.g. one per CudaGraphRunner)
    the compiled kernel of the first launch is kept there and later launches call its launcher
    directly: Triton's Python-side argument binding, specialization key and cache lookup cost tens
    of microseconds of host time, paid on every decode step of a graph. The kernel specializes
    only on its pointers' 16-byte alignment and the table's row stride (every size is marked not
    to specialize), so those are the key; a driver launch hook (a profiler) takes the normal path."""
    cells = layout.num_seqs * layout.width
    extent = max(layout.rows, layout.bucket + 1, cells)
    grid = triton.cdiv(extent, UNPACK_BLOCK)
    args = (staging, tokens, buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
            buffers.query_start_loc, buffers.block_table, layout.rows, layout.live_rows, layout.bucket, cells,
            layout.width, buffers.block_table.stride(0), layout.table_offset)
    key = (staging.device.index, tuple(t.data_ptr() % 16 == 0 for t in args[:8]), args[13])
    launch_kept(_unpack_kernel, grid, args, UNPACK_BLOCK, launches, key, staging.device, "unpack kernel")


@triton.jit
def _slot(table_ptr, stride_table, seq, pos, block_size, live):
    """The flat KV slot of position pos of sequence seq (int64), -1 where not live."""
    block = tl.load(table_ptr + seq * stride_table + pos // block_size, mask=live, other=0).to(tl.int64)
    return tl.where(live, block * block_size + pos % block_size, -1)


@triton.jit
def _store_accepted(greedy_ptr, caps_ptr, accepted_ptr, next_token_ptr, num_live_ptr, seqs, live, accepted, num_seqs,
                    q, HAS_CAPS: tl.constexpr):
    """Cap the counts, store them and each sequence's next token (the target's at that row)."""
    if HAS_CAPS:
        accepted = tl.minimum(accepted, tl.load(caps_ptr + seqs, mask=live, other=0))
    tl.store(accepted_ptr + seqs, accepted, mask=live)
    tl.store(next_token_ptr + seqs, tl.load(greedy_ptr + seqs * q + accepted, mask=live, other=0), mask=live)
    if tl.program_id(0) == 0:
        tl.store(num_live_ptr, num_seqs.to(tl.int64))


@triton.jit(do_not_specialize=["num_seqs", "stride_drafts"])
def _accept_kernel(
    greedy_ptr,  # [B, q] int64
    drafts_ptr,  # [B, k] int64 at (stride_drafts, 1)
    caps_ptr,  # [B] int64 (read with HAS_CAPS)
    accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    num_live_ptr,  # 0-d int64 out
    num_seqs,
    stride_drafts,
    K: tl.constexpr,
    K_P: tl.constexpr,
    HAS_CAPS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # every read may depend on the kernel before
    seqs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    live = seqs < num_seqs
    j = tl.arange(0, K_P)  # [K_P] draft index
    in_k = (j < K)[None, :] & live[:, None]
    q = K + 1
    target = tl.load(greedy_ptr + seqs[:, None] * q + j[None, :], mask=in_k, other=0)
    drafted = tl.load(drafts_ptr + seqs[:, None] * stride_drafts + j[None, :], mask=in_k, other=-1)
    first_miss = tl.where(target != drafted, j[None, :], K)  # [BLOCK, K_P]: K where they agree
    accepted = tl.min(first_miss, axis=1).to(tl.int64)
    _store_accepted(greedy_ptr, caps_ptr, accepted_ptr, next_token_ptr, num_live_ptr, seqs, live, accepted, num_seqs,
                    q, HAS_CAPS)


def accept_drafts_triton(greedy, drafts, caps, accepted_out, next_token_out, num_live_out) -> None:
    num_seqs, k = drafts.shape
    assert greedy.is_contiguous() and greedy.shape == (num_seqs, k + 1) and drafts.stride(1) == 1
    _accept_kernel[(triton.cdiv(num_seqs, BLOCK_SEQS),)](
        greedy, drafts, caps if caps is not None else greedy, accepted_out, next_token_out, num_live_out,
        num_seqs, drafts.stride(0),
        K=k, K_P=triton.next_power_of_2(max(k, 1)), HAS_CAPS=caps is not None, BLOCK=BLOCK_SEQS, **_pdl(greedy),
    )


@triton.jit(do_not_specialize=["num_seqs", "start"])
def _accept_drawn_kernel(
    greedy_ptr,  # [B, q] int64
    caps_ptr,  # [B] int64 (read with HAS_CAPS)
    rates_ptr,  # [k] float64
    accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    num_live_ptr,  # 0-d int64 out
    num_seqs,
    start,  # float64: sequence i draws frac(start + i * row_stride)
    row_stride,
    K: tl.constexpr,
    K_P: tl.constexpr,
    HAS_CAPS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # every read may depend on the kernel before
    seqs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    live = seqs < num_seqs
    j = tl.arange(0, K_P)  # [K_P] draft index
    x = seqs.to(tl.float64) * row_stride + start
    uniform = x - tl.floor(x)  # [BLOCK] in [0, 1)
    rates = tl.load(rates_ptr + j, mask=j < K, other=-1.0)  # [K_P]; padding never counts
    accepted = tl.sum((uniform[:, None] < rates[None, :]).to(tl.int64), axis=1)
    _store_accepted(greedy_ptr, caps_ptr, accepted_ptr, next_token_ptr, num_live_ptr, seqs, live, accepted, num_seqs,
                    K + 1, HAS_CAPS)


def accept_drawn_triton(greedy, start, rates, row_stride, caps, accepted_out, next_token_out, num_live_out) -> None:
    num_seqs, q = greedy.shape
    k = q - 1
    assert greedy.is_contiguous() and rates.shape == (k,)
    _accept_drawn_kernel[(triton.cdiv(num_seqs, BLOCK_SEQS),)](
        greedy, caps if caps is not None else greedy, rates, accepted_out, next_token_out, num_live_out,
        num_seqs, float(start), row_stride,
        K=k, K_P=triton.next_power_of_2(max(k, 1)), HAS_CAPS=caps is not None, BLOCK=BLOCK_SEQS, **_pdl(greedy),
    )


@triton.jit(do_not_specialize=["num_seqs", "stride_tokens", "stride_first_pos", "stride_table", "block_size",
                               "last_position"])
def _catch_up_kernel(
    tokens_ptr,  # [B, q] int64 at (stride_tokens, 1)
    first_pos_ptr,  # [B] int64 at stride_first_pos
    accepted_ptr,  # [B] int64
    next_token_ptr,  # [B] int64
    num_live_ptr,  # 0-d int64
    table_ptr,  # [B, W] int32 at (stride_table, 1)
    fed_ptr,  # [B * n] int64 out
    positions_ptr,  # [B * n] int64 out
    slots_ptr,  # [B * n] int64 out
    seq_lens_ptr,  # [B] int32 out
    last_rows_ptr,  # [B] int64 out
    chained_positions_ptr,  # [S, B] int64 out
    chained_seq_lens_ptr,  # [S, B] int32 out
    chained_slots_ptr,  # [S, B] int64 out
    num_seqs,
    stride_tokens,
    stride_first_pos,
    stride_table,
    block_size,
    last_position,  # max_model_len - 1: rows past it are placed at it (dispatch.catch_up_inputs)
    Q: tl.constexpr,
    N: tl.constexpr,
    N_P: tl.constexpr,
    SHIFT: tl.constexpr,
    STEPS: tl.constexpr,
    STEPS_P: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # every read may depend on the kernel before
    seq = tl.program_id(0)
    p0 = tl.load(first_pos_ptr + seq * stride_first_pos)
    a = tl.load(accepted_ptr + seq)
    x = tl.load(next_token_ptr + seq)
    live = seq < tl.load(num_live_ptr)
    r = tl.arange(0, N_P)  # catch-up rows
    in_rows = r < N
    writes_kv = r < tl.where(live, N, 0)  # padding sequences write none
    o = r + SHIFT  # the position offset whose token row r feeds
    from_step = in_rows & (o < Q) & (o <= a)  # tokens t, d_1 .. d_a of the verify step; x after them
    fed = tl.where(from_step, tl.load(tokens_ptr + seq * stride_tokens + o, mask=from_step, other=0), x)
    pos = tl.minimum(p0 + r, last_position)
    out = seq * N + r
    tl.store(fed_ptr + out, fed, mask=in_rows)
    tl.store(positions_ptr + out, pos, mask=in_rows)
    tl.store(slots_ptr + out, _slot(table_ptr, stride_table, seq, pos, block_size, writes_kv), mask=in_rows)
    tl.store(seq_lens_ptr + seq, tl.minimum(p0 + N, last_position + 1).to(tl.int32))
    next_row = a + 1 - SHIFT
    tl.store(last_rows_ptr + seq, seq * N + next_row)
    # Chained step j (1..STEPS) feeds one row at draft 1's position + j.
    j = tl.arange(0, STEPS_P)
    in_steps = j < STEPS
    step_pos = tl.minimum(p0 + next_row + 1 + j, last_position)
    step_out = j * num_seqs + seq
    tl.store(chained_positions_ptr + step_out, step_pos, mask=in_steps)
    tl.store(chained_seq_lens_ptr + step_out, (step_pos + 1).to(tl.int32), mask=in_steps)
    step_slots = _slot(table_ptr, stride_table, seq, step_pos, block_size, j < tl.where(live, STEPS, 0))
    tl.store(chained_slots_ptr + step_out, step_slots, mask=in_steps)


def catch_up_inputs_triton(tokens, first_pos, accepted, next_token, num_live, table, block_size, rows_per_seq,
                           shift, chained_steps, last_position) -> CatchUpInputs:
    num_seqs, q = tokens.shape
    n = rows_per_seq
    i64 = dict(dtype=torch.int64, device=tokens.device)
    i32 = dict(dtype=torch.int32, device=tokens.device)
    steps = (chained_steps, num_seqs)
    chained = ChainStepInputs(torch.empty(steps, **i64), torch.empty(steps, **i32), torch.empty(steps, **i64))
    out = CatchUpInputs(torch.empty(num_seqs * n, **i64), torch.empty(num_seqs * n, **i64),
                        torch.empty(num_seqs * n, **i64), torch.empty(num_seqs, **i32), torch.empty(num_seqs, **i64),
                        chained)
    assert tokens.stride(1) == 1 and table.stride(1) == 1
    _catch_up_kernel[(num_seqs,)](
        tokens, first_pos, accepted, next_token, num_live, table, out.tokens, out.positions, out.slots,
        out.seq_lens, out.last_rows, chained.positions, chained.seq_lens, chained.slots,
        num_seqs, tokens.stride(0), first_pos.stride(0), table.stride(0), block_size, last_position,
        Q=q, N=n, N_P=triton.next_power_of_2(n), SHIFT=shift, STEPS=chained_steps,
        STEPS_P=triton.next_power_of_2(max(chained_steps, 1)), **_pdl(tokens),
    )
    return out


@triton.jit(do_not_specialize=["num_seqs", "stride_table", "stride_drafts", "stride_draft_step", "block_size"])
def _advance_kernel(
    input_ids_ptr,  # [B * q] int64 out
    positions_ptr,  # [B * q] int64: row 0 of each sequence read, then all written
    slot_mapping_ptr,  # [B * q] int64 out
    seq_lens_ptr,  # [B] int32 out
    table_ptr,  # [B, W] int32 at (stride_table, 1)
    accepted_ptr,  # [B] int64
    next_token_ptr,  # [B] int64
    drafts_ptr,  # [B, q - 1] int64 at (stride_drafts, stride_draft_step)
    num_seqs,
    stride_table,
    stride_drafts,
    stride_draft_step,
    block_size,
    Q: tl.constexpr,
    Q_P: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # every read may depend on the kernel before
    seq = tl.program_id(0)
    r = tl.arange(0, Q_P)
    in_rows = r < Q
    start = tl.load(positions_ptr + seq * Q) + tl.load(accepted_ptr + seq) + 1
    is_draft = in_rows & (r > 0)
    drafted = tl.load(drafts_ptr + seq * stride_drafts + (r - 1) * stride_draft_step, mask=is_draft, other=0)
    token = tl.where(r == 0, tl.load(next_token_ptr + seq), drafted)
    pos = start + r
    rows = seq * Q + r
    tl.store(input_ids_ptr + rows, token, mask=in_rows)
    tl.store(slot_mapping_ptr + rows, _slot(table_ptr, stride_table, seq, pos, block_size, in_rows), mask=in_rows)
    tl.store(positions_ptr + rows, pos, mask=in_rows)  # after row 0 was read: its value feeds every store
    tl.store(seq_lens_ptr + seq, (start + Q).to(tl.int32))


def advance_verify_inputs_triton(input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token, drafts,
                                 block_size) -> None:
    num_seqs, q = drafts.shape[0], drafts.shape[1] + 1
    assert table.stride(1) == 1
    _advance_kernel[(num_seqs,)](
        input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token, drafts,
        num_seqs, table.stride(0), drafts.stride(0), drafts.stride(1), block_size, Q=q, Q_P=triton.next_power_of_2(q),
        **_pdl(input_ids),
    )
