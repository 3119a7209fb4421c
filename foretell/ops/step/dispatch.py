"""The entry points of the step bookkeeping: the Triton kernel (triton_kernels.py, one launch
each) where ops.common.kernel_choice.use_triton allows, else the torch twin (reference.py).
Shapes and the meaning of each piece: reference.py."""

from __future__ import annotations

import torch

from foretell.ops.common import kernel_choice
from foretell.ops.step import reference
from foretell.ops.step.inputs import CatchUpInputs, GraphInputBuffers, PackedLayout


def unpack_graph_inputs(staging: torch.Tensor, tokens: torch.Tensor, buffers: GraphInputBuffers,
                        layout: PackedLayout, launches: dict | None = None) -> None:
    """Scatter staging [layout.size] (int64, a packed step: runner/graph_inputs.py) and tokens
    [live_rows] into a graph's input buffers. `launches`: a dict the caller keeps for the Triton
    launch's compiled kernels (direct launches after the first: triton_kernels.py)."""
    if kernel_choice.use_triton(staging):
        from foretell.ops.step import triton_kernels  # imports triton: CUDA only

        triton_kernels.unpack_graph_inputs_triton(staging, tokens, buffers, layout, launches)
        return
    reference.unpack_graph_inputs_torch(staging, tokens, buffers, layout)


def accept_drafts(
    greedy: torch.Tensor,  # [B, q] int64: the target's greedy token at each verify row
    drafts: torch.Tensor,  # [B, k] int64: the drafts verified (rows 1..k of the step's input ids)
    caps: torch.Tensor | None,  # [B] int64: most drafts each may accept (near max_tokens), or None
    accepted_out: torch.Tensor,  # [>= B] int64, written
    next_token_out: torch.Tensor,  # [>= B] int64, written
    num_live_out: torch.Tensor,  # 0-d int64, set to B
) -> None:
    """Greedy verification: each sequence accepts its drafts up to the first that differs from
    the target's token, capped; its next token is the target's at the row after them."""
    if kernel_choice.use_triton(greedy):
        from foretell.ops.step import triton_kernels  # imports triton: CUDA only

        triton_kernels.accept_drafts_triton(greedy, drafts, caps, accepted_out, next_token_out, num_live_out)
        return
    reference.accept_drafts_torch(greedy, drafts, caps, accepted_out, next_token_out, num_live_out)


def greedy_accepted(
    greedy: torch.Tensor,  # [B, q] int64
    drafts: torch.Tensor,  # [B, k] int64
    caps: torch.Tensor | None,  # [B] int64, or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_drafts into new tensors: (accepted [B], next token [B]), for a step whose results are
    not static buffers (the step from host inputs)."""
    if kernel_choice.use_triton(greedy):
        accepted, next_token, num_live = _outputs(greedy)
        accept_drafts(greedy, drafts, caps, accepted, next_token, num_live)
        return accepted, next_token
    return reference.greedy_accepted_torch(greedy, drafts, caps)


def drawn_accepted(
    greedy: torch.Tensor, start: float, rates: torch.Tensor, row_stride: float, caps: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_drawn into new tensors: (accepted [B], next token [B])."""
    if kernel_choice.use_triton(greedy):
        accepted, next_token, num_live = _outputs(greedy)
        accept_drawn(greedy, start, rates, row_stride, caps, accepted, next_token, num_live)
        return accepted, next_token
    return reference.drawn_accepted_torch(greedy, start, rates, row_stride, caps)


def _outputs(greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs = greedy.shape[0]
    i64 = dict(dtype=torch.int64, device=greedy.device)
    return torch.empty(num_seqs, **i64), torch.empty(num_seqs, **i64), torch.empty((), **i64)


def accept_drawn(
    greedy: torch.Tensor,  # [B, q] int64: the target's greedy token at each verify row
    start: float,  # sequence i draws u = frac(start + i * row_stride)
    rates: torch.Tensor,  # [k] float64: P(accepted >= j), non-increasing
    row_stride: float,
    caps: torch.Tensor | None,  # [B] int64, or None
    accepted_out: torch.Tensor,  # [>= B] int64, written
    next_token_out: torch.Tensor,  # [>= B] int64, written
    num_live_out: torch.Tensor,  # 0-d int64, set to B
) -> None:
    """Drawn acceptance (simulated, spec_decode/simulated_acceptance.py): each sequence accepts as
    many drafts as rates lie above its draw, capped; its next token is the target's at that row."""
    if kernel_choice.use_triton(greedy):
        from foretell.ops.step import triton_kernels  # imports triton: CUDA only

        triton_kernels.accept_drawn_triton(greedy, start, rates, row_stride, caps, accepted_out, next_token_out,
                                           num_live_out)
        return
    reference.accept_drawn_torch(greedy, start, rates, row_stride, caps, accepted_out, next_token_out, num_live_out)


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
    Catch-up rows past it (a verify's padded rows near the limit) are placed there the same way,
    with the sequence's context capped there: their drafts are never used either."""
    args = (tokens, first_pos, accepted, next_token, num_live, table, block_size, rows_per_seq, shift,
            chained_steps, last_position)
    if kernel_choice.use_triton(tokens):
        from foretell.ops.step import triton_kernels  # imports triton: CUDA only

        return triton_kernels.catch_up_inputs_triton(*args)
    return reference.catch_up_inputs_torch(*args)


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
    args = (input_ids, positions, slot_mapping, seq_lens, table, accepted, next_token, drafts, block_size)
    if kernel_choice.use_triton(input_ids):
        from foretell.ops.step import triton_kernels  # imports triton: CUDA only

        triton_kernels.advance_verify_inputs_triton(*args)
        return
    reference.advance_verify_inputs_torch(*args)
