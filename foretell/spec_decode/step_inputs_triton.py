"""One launch for each piece of a graphed verify step's bookkeeping (spec_decode/step_inputs.py has
the torch twins and the shapes). Sizes that change from step to step are not specialized on, so
no step compiles a new variant (runner/graph_inputs_triton.py says why). Imports triton: CUDA
(or the interpreter tests) only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled
from foretell.spec_decode.simulated_acceptance import ROW_STRIDE
from foretell.spec_decode.step_inputs import CatchUpInputs, ChainStepInputs

BLOCK_SEQS = 64  # sequences per program (the graph buckets go up to max_num_seqs)


def _pdl(t: torch.Tensor) -> dict:
    """PDL's constexpr and launch option (ops/common/pdl.py): each of these launches right behind the
    kernel before it and waits for it first, so the chain of small launches between two graphs'
    weight streams pays less of each launch's latency."""
    pdl = pdl_enabled(t)
    return {"PDL": pdl, **launch_options(pdl)}


@triton.jit
def _slot(table_ptr, stride_table, seq, pos, block_size, live):
    """The flat KV slot of position pos of sequence seq (int64), -1 where not live."""
    block = tl.load(table_ptr + seq * stride_table + pos // block_size, mask=live, other=0).to(tl.int64)
    return tl.where(live, block * block_size + pos % block_size, -1)


@triton.jit(do_not_specialize=["num_seqs", "sim_start"])
def _accept_kernel(
    greedy_ptr,  # [B, q] int64
    drafts_ptr,  # [B, k] int64 at (stride_drafts, 1)
    caps_ptr,  # [B] int64 (read with HAS_CAPS)
    rates_ptr,  # [k] float64 (read with SIMULATED)
    accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    num_live_ptr,  # 0-d int64 out
    num_seqs,
    stride_drafts,
    sim_start,  # float64: sequence i draws frac(sim_start + i * row_stride)
    row_stride,
    K: tl.constexpr,
    K_P: tl.constexpr,
    HAS_CAPS: tl.constexpr,
    SIMULATED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # every read may depend on the kernel before
    seqs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    live = seqs < num_seqs
    j = tl.arange(0, K_P)  # [K_P] draft index
    in_k = (j < K)[None, :] & live[:, None]
    q = K + 1
    if SIMULATED:
        x = seqs.to(tl.float64) * row_stride + sim_start
        uniform = x - tl.floor(x)  # [BLOCK] in [0, 1)
        rates = tl.load(rates_ptr + j, mask=j < K, other=-1.0)  # [K_P]; padding never counts
        accepted = tl.sum((uniform[:, None] < rates[None, :]).to(tl.int64), axis=1)
    else:
        target = tl.load(greedy_ptr + seqs[:, None] * q + j[None, :], mask=in_k, other=0)
        drafted = tl.load(drafts_ptr + seqs[:, None] * stride_drafts + j[None, :], mask=in_k, other=-1)
        first_miss = tl.where(target != drafted, j[None, :], K)  # [BLOCK, K_P]: K where they agree
        accepted = tl.min(first_miss, axis=1).to(tl.int64)
    if HAS_CAPS:
        accepted = tl.minimum(accepted, tl.load(caps_ptr + seqs, mask=live, other=0))
    tl.store(accepted_ptr + seqs, accepted, mask=live)
    tl.store(next_token_ptr + seqs, tl.load(greedy_ptr + seqs * q + accepted, mask=live, other=0), mask=live)
    if tl.program_id(0) == 0:
        tl.store(num_live_ptr, num_seqs.to(tl.int64))


def accept_drafts_triton(greedy, drafts, caps, simulated, accepted_out, next_token_out, num_live_out) -> None:
    num_seqs, k = drafts.shape
    assert greedy.is_contiguous() and greedy.shape == (num_seqs, k + 1) and drafts.stride(1) == 1
    start, rates = simulated if simulated is not None else (0.0, greedy)
    _accept_kernel[(triton.cdiv(num_seqs, BLOCK_SEQS),)](
        greedy, drafts, caps if caps is not None else greedy, rates, accepted_out, next_token_out, num_live_out,
        num_seqs, drafts.stride(0), float(start), ROW_STRIDE,
        K=k, K_P=triton.next_power_of_2(k), HAS_CAPS=caps is not None, SIMULATED=simulated is not None,
        BLOCK=BLOCK_SEQS, **_pdl(greedy),
    )


@triton.jit(do_not_specialize=["num_seqs"])
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
    last_position,  # max_model_len - 1: rows past it are placed at it (step_inputs.catch_up_inputs)
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


@triton.jit(do_not_specialize=["num_seqs"])
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
