"""The bookkeeping of a graphed greedy verify step, each piece one launch on CUDA.

Between the target's verify graph and the draft layers, and between the draft loop and the next
verify graph, a step computes small integer tensors: how many drafts each sequence accepted and
its next token; the tokens, positions and KV slots of the draft's catch-up rows and of each
chained draft step; the next verify step's inputs. As torch ops that was most of the 90 small
launches (131 us) of a 5.2 ms Llama-8B EAGLE3 step on the H200; with one Triton kernel per piece
on CUDA (spec_decode/step_inputs_triton.py) 26 small launches (50 us) are left and the step runs
0.05 ms beyond its two graphs, not 0.12-0.15 (scripts/profile_decode.py, BENCHMARKS.md). Elsewhere
the torch twins below run; tests hold them together (tests/test_step_inputs.py).

Shapes: B sequences (a graph bucket), q = k + 1 verify rows each, n catch-up rows each. A
sequence is live when its index is below num_live (a 0-d device tensor); padding sequences write
no KV (slot -1). Slots are flat token slots of the target's paged cache:
table[b, pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.spec_decode.simulated_acceptance import simulated_counts


@dataclass
class ChainStepInputs:
    positions: torch.Tensor  # [B] int64 ([S, B]: every chained step's, step j in row j - 1)
    seq_lens: torch.Tensor  # [B] int32
    slots: torch.Tensor  # [B] int64, -1 for padding sequences


@dataclass
class CatchUpInputs:
    tokens: torch.Tensor  # [B * n] int64: the token fed at each catch-up row
    positions: torch.Tensor  # [B * n] int64
    slots: torch.Tensor  # [B * n] int64, -1 for padding sequences
    seq_lens: torch.Tensor  # [B] int32: context after the catch-up rows
    last_rows: torch.Tensor  # [B] int64: the row (of all B * n) that drafts token 1
    chained: ChainStepInputs  # [S, B] each: the inputs of chained steps 1 .. S (S may be 0)

    def chain_step(self, j: int) -> ChainStepInputs:
        """The single-row step that feeds draft j (1 <= j <= S): its row sits j past draft 1's."""
        return ChainStepInputs(self.chained.positions[j - 1], self.chained.seq_lens[j - 1], self.chained.slots[j - 1])


def _slots(table: torch.Tensor, positions: torch.Tensor, live: torch.Tensor, block_size: int) -> torch.Tensor:
    """table [B, W] int32, positions [B, r] int64, live [B] bool -> slots [B, r] int64."""
    blocks = table.gather(1, positions // block_size).to(torch.int64)
    return torch.where(live[:, None], blocks * block_size + positions % block_size, -1)


def accept_drafts(
    greedy: torch.Tensor,  # [B, q] int64: the target's greedy token at each verify row
    drafts: torch.Tensor,  # [B, k] int64: the drafts verified (rows 1..k of the step's input ids)
    caps: torch.Tensor | None,  # [B] int64: most drafts each may accept (near max_tokens), or None
    simulated: tuple[float, torch.Tensor] | None,  # (draw start, rates [k] float64): drawn counts
    accepted_out: torch.Tensor,  # [>= B] int64, written
    next_token_out: torch.Tensor,  # [>= B] int64, written
    num_live_out: torch.Tensor,  # 0-d int64, set to B
) -> None:
    """Greedy verification: each sequence accepts its drafts up to the first that differs from
    the target's token (or a drawn count: simulated_acceptance.py), capped; its next token is
    the target's at the row after them."""
    if greedy.is_cuda:
        from foretell.spec_decode.step_inputs_triton import accept_drafts_triton  # imports triton: CUDA only

        accept_drafts_triton(greedy, drafts, caps, simulated, accepted_out, next_token_out, num_live_out)
        return
    accept_drafts_torch(greedy, drafts, caps, simulated, accepted_out, next_token_out, num_live_out)


def accept_drafts_torch(greedy, drafts, caps, simulated, accepted_out, next_token_out, num_live_out) -> None:
    num_seqs, k = drafts.shape
    if simulated is not None:
        accepted = simulated_counts(simulated[0], simulated[1], num_seqs)
    else:
        accepted = (greedy[:, :k] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)
    if caps is not None:
        accepted = torch.minimum(accepted, caps)
    accepted_out[:num_seqs].copy_(accepted)
    next_token_out[:num_seqs].copy_(greedy.gather(1, accepted[:, None]).squeeze(1))
    num_live_out.fill_(num_seqs)


def catch_up_inputs(
    tokens: torch.Tensor,  # [B, q] int64: the verify step's input tokens
    first_pos: torch.Tensor,  # [B] int64: the verify step's first position p0
    accepted: torch.Tensor,  # [B] int64
    next_token: torch.Tensor,  # [B] int64
    num_live: torch.Tensor,  # 0-d int64
    table: torch.Tensor,  # [B, W] int32, the target's blocks
    block_size: int,
    rows_per_seq: int,  # n
    shift: int,  # 1 when row r reads the token at p0 + r + 1 (EAGLE3, MTP), 0 for a draft LM
    chained_steps: int,  # S: the single-row steps after the catch-up (k - 1)
    last_position: int,  # max_model_len - 1: no row is placed past it
) -> CatchUpInputs:
    """The catch-up over positions p0 .. p0 + n - 1, whose tokens are [t, d_1 .. d_a, x] (x also
    past them). Row a + 1 - shift sees x and drafts token 1; chained step j's row sits j past it
    (its inputs come from the same launch: no launch between two draft steps).

    Near max_model_len a chained step whose draft could never be verified (its position is at or
    past the limit, which the scheduler never verifies) sits at last_position instead: the rotary
    table, its KV slot and its context stay within the limit, and its draft is never accepted.
    The runner only graphs batches whose catch-up rows fit (p0 + n - 1 <= last_position); rows
    past it would be clamped the same way, with the sequence's context capped there."""
    if tokens.is_cuda:
        from foretell.spec_decode.step_inputs_triton import catch_up_inputs_triton  # imports triton: CUDA only

        return catch_up_inputs_triton(tokens, first_pos, accepted, next_token, num_live, table, block_size,
                                      rows_per_seq, shift, chained_steps, last_position)
    return catch_up_inputs_torch(tokens, first_pos, accepted, next_token, num_live, table, block_size,
                                 rows_per_seq, shift, chained_steps, last_position)


def catch_up_inputs_torch(tokens, first_pos, accepted, next_token, num_live, table, block_size, rows_per_seq,
                          shift, chained_steps, last_position) -> CatchUpInputs:
    num_seqs, q = tokens.shape
    n = rows_per_seq
    offset = torch.arange(q + 1, device=tokens.device)  # position offsets p0 + 0 .. p0 + q
    at_position = torch.cat([tokens, next_token[:, None]], dim=1)  # [B, q + 1]
    at_position = torch.where(offset[None, :] <= accepted[:, None], at_position, next_token[:, None])
    positions = (first_pos[:, None] + offset[None, :n]).clamp(max=last_position)  # [B, n]
    live = torch.arange(num_seqs, device=tokens.device) < num_live
    next_row = accepted + (1 - shift)
    steps = torch.arange(1, chained_steps + 1, device=tokens.device)
    chained = (first_pos[:, None] + next_row[:, None] + steps).clamp(max=last_position)  # [B, S]: step j's position
    return CatchUpInputs(
        tokens=at_position[:, shift : shift + n].flatten(),
        positions=positions.flatten(),
        slots=_slots(table, positions, live, block_size).flatten(),
        seq_lens=(first_pos + n).clamp(max=last_position + 1).to(torch.int32),
        last_rows=torch.arange(num_seqs, device=tokens.device) * n + next_row,
        chained=ChainStepInputs(chained.t().contiguous(), (chained + 1).t().to(torch.int32).contiguous(),
                                _slots(table, chained, live, block_size).t().contiguous()),
    )


def advance_verify_inputs(
    input_ids: torch.Tensor,  # [>= B * q] int64, written
    positions: torch.Tensor,  # [>= B * q] int64: read (each sequence's first row), then written
    slot_mapping: torch.Tensor,  # [>= B * q] int64, written
    seq_lens: torch.Tensor,  # [>= B] int32, written
    table: torch.Tensor,  # [B, W] int32: the sequences' blocks now
    accepted: torch.Tensor,  # [B] int64: drafts the step in the buffers accepted
    next_token: torch.Tensor,  # [B] int64
    drafts: torch.Tensor,  # [B, q - 1] int64: the drafts to verify next
    block_size: int,
) -> None:
    """A verify step's input buffers turned into the next one's: each sequence moves past its
    accepted drafts and next token (p0 -> p0 + accepted + 1) and feeds [next_token, drafts]."""
    if input_ids.is_cuda:
        from foretell.spec_decode.step_inputs_triton import advance_verify_inputs_triton  # imports triton: CUDA only

        advance_verify_inputs_triton(input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token,
                                     drafts, block_size)
        return
    advance_verify_inputs_torch(input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token, drafts,
                                block_size)


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
