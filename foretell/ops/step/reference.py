"""Plain-torch twins of the step bookkeeping kernels (triton_kernels.py): what the CPU runs, and
what the kernels are held to (tests/ops/test_step_inputs.py, tests/ops/test_step_graph_inputs.py).
catch_up_rows_torch is also the step from host inputs' catch-up (spec_decode/draft_loop.py): one
definition of the rows a drafter catches up over, for both step forms.

Between the target's verify graph and the draft layers, and between the draft loop and the next
verify graph, a step computes small integer tensors: how many drafts each sequence accepted and
its next token; the tokens, positions and KV slots of the draft's catch-up rows and of each
chained draft step; the next verify step's inputs. As torch ops on CUDA that was most of the 90
small launches of a Llama-8B EAGLE3 step on the H200; the kernels do each piece in one launch
(docs/perf-log.md has the measurements).

Shapes: B sequences (a graph bucket), q = k + 1 verify rows each, n catch-up rows each. A
sequence is live when its index is below num_live (a 0-d device tensor); padding sequences write
no KV (slot -1). Slots are flat token slots of the target's paged cache:
table[b, pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

import torch

from foretell.ops.step.inputs import CatchUpInputs, ChainStepInputs, GraphInputBuffers, PackedLayout


def _slots(table: torch.Tensor, positions: torch.Tensor, live: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """table [B, W] int32, positions [B, r] int64, live [B] bool (None: all) -> slots [B, r] int64."""
    blocks = table.gather(1, positions // block_size).to(torch.int64)
    slots = blocks * block_size + positions % block_size
    return slots if live is None else torch.where(live[:, None], slots, -1)


def unpack_graph_inputs_torch(staging: torch.Tensor, tokens: torch.Tensor, buffers: GraphInputBuffers,
                              layout: PackedLayout) -> None:
    rows, bucket, n, width = layout.rows, layout.bucket, layout.num_seqs, layout.width
    buffers.positions[:rows].copy_(staging[:rows])
    buffers.slot_mapping[:rows].copy_(staging[rows : 2 * rows])
    buffers.seq_lens[:bucket].copy_(staging[2 * rows : 2 * rows + bucket])
    buffers.query_start_loc[: bucket + 1].copy_(staging[2 * rows + bucket : layout.table_offset])
    table = staging[layout.table_offset : layout.ids_offset].view(n, width)
    buffers.block_table[:n, :width].copy_(table)
    buffers.input_ids[: layout.live_rows].copy_(tokens)


def _capped(greedy, accepted, caps) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [B] capped, next token [B]: the target's at the row after the accepted drafts)."""
    if caps is not None:
        accepted = torch.minimum(accepted, caps)
    return accepted, greedy.gather(1, accepted[:, None]).squeeze(1)


def _write(values: tuple[torch.Tensor, torch.Tensor], accepted_out, next_token_out, num_live_out) -> None:
    accepted, next_token = values
    num_seqs = accepted.shape[0]
    accepted_out[:num_seqs].copy_(accepted)
    next_token_out[:num_seqs].copy_(next_token)
    num_live_out.fill_(num_seqs)


def greedy_accepted_torch(greedy, drafts, caps) -> tuple[torch.Tensor, torch.Tensor]:
    accepted = (greedy[:, : drafts.shape[1]] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return _capped(greedy, accepted, caps)


def accept_drafts_torch(greedy, drafts, caps, accepted_out, next_token_out, num_live_out) -> None:
    _write(greedy_accepted_torch(greedy, drafts, caps), accepted_out, next_token_out, num_live_out)


def drawn_counts(start: float, rates: torch.Tensor, num_seqs: int, row_stride: float) -> torch.Tensor:
    """[num_seqs] int64 accepted counts of one step: rates [k] float64; sequence i draws
    u = frac(start + i * row_stride) and accepts the number of rates above u."""
    row = torch.arange(num_seqs, dtype=torch.float64, device=rates.device)  # [num_seqs]
    uniform = torch.remainder(row * row_stride + start, 1.0)
    return (uniform[:, None] < rates[None, :]).sum(dim=1)


def drawn_accepted_torch(greedy, start, rates, row_stride, caps) -> tuple[torch.Tensor, torch.Tensor]:
    return _capped(greedy, drawn_counts(start, rates, greedy.shape[0], row_stride), caps)


def accept_drawn_torch(greedy, start, rates, row_stride, caps, accepted_out, next_token_out, num_live_out) -> None:
    _write(drawn_accepted_torch(greedy, start, rates, row_stride, caps), accepted_out, next_token_out, num_live_out)


def catch_up_rows_torch(tokens, first_pos, accepted, next_token, live, table, block_size, rows_per_seq, shift,
                        last_position) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which token each catch-up row is fed, its position and its KV slot: the one definition, for
    the padded step (catch_up_inputs_torch, and the Triton twin held to it) and the step from host
    inputs (spec_decode/draft_loop.catch_up_rows). Row r of a sequence sits at p0 + r (at most
    last_position) and is fed the token at p0 + r + shift of [t, d_1 .. d_a, x] (x also past it).
    tokens [B, q], first_pos / accepted / next_token [B], live [B] bool (None: all), table [B, W]
    -> (tokens [B, n], positions [B, n], slots [B, n]), n = rows_per_seq <= q + 1 - shift."""
    q, n = tokens.shape[1], rows_per_seq
    offset = torch.arange(q + 1, device=tokens.device)  # position offsets p0 + 0 .. p0 + q
    at_position = torch.cat([tokens, next_token[:, None]], dim=1)  # [B, q + 1]
    at_position = torch.where(offset[None, :] <= accepted[:, None], at_position, next_token[:, None])
    positions = (first_pos[:, None] + offset[None, :n]).clamp(max=last_position)  # [B, n]
    return at_position[:, shift : shift + n], positions, _slots(table, positions, live, block_size)


def catch_up_inputs_torch(tokens, first_pos, accepted, next_token, num_live, table, block_size, rows_per_seq,
                          shift, chained_steps, last_position) -> CatchUpInputs:
    num_seqs, n = tokens.shape[0], rows_per_seq
    live = torch.arange(num_seqs, device=tokens.device) < num_live
    fed, positions, slots = catch_up_rows_torch(tokens, first_pos, accepted, next_token, live, table, block_size, n,
                                                shift, last_position)
    next_row = accepted + (1 - shift)
    steps = torch.arange(1, chained_steps + 1, device=tokens.device)
    chained = (first_pos[:, None] + next_row[:, None] + steps).clamp(max=last_position)  # [B, S]: step j's position
    return CatchUpInputs(
        tokens=fed.flatten(),
        positions=positions.flatten(),
        slots=slots.flatten(),
        seq_lens=(first_pos + n).clamp(max=last_position + 1).to(torch.int32),
        last_rows=torch.arange(num_seqs, device=tokens.device) * n + next_row,
        chained=ChainStepInputs(chained.t().contiguous(), (chained + 1).t().to(torch.int32).contiguous(),
                                _slots(table, chained, live, block_size).t().contiguous()),
    )


def advance_verify_inputs_torch(input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token, drafts,
                                block_size) -> None:
    num_seqs, q = drafts.shape[0], drafts.shape[1] + 1
    rows = num_seqs * q
    start = positions[:rows].view(num_seqs, q)[:, 0] + accepted + 1  # [B]
    new_positions = start[:, None] + torch.arange(q, device=positions.device)  # [B, q]
    live = torch.ones(num_seqs, dtype=torch.bool, device=positions.device)
    slot_mapping[:rows].copy_(_slots(table, new_positions, live, block_size).flatten())
    input_ids[:rows].copy_(torch.cat([next_token[:, None], drafts], dim=1).flatten())
    positions[:rows].copy_(new_positions.flatten())
    seq_lens[:num_seqs].copy_(start + q)
