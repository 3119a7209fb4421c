"""The plain decode step after a host drafter's verify step, its graph inputs made on the device
from the verify's (issue 29).

A host drafter's drafting step (n-gram, suffix: runner/host_verify.py) is verified on the host
after its read, and its drafter proposes after that, so nothing of the next step can be known on
the device: except that most such steps are followed by a step without drafts (the match ends).
That step is queued ahead as a plain decode step on the guess that the drafter drafts nothing
next, before the verify is read: each sequence feeds the token the target picked after its
accepted drafts, one position past them, in the (bucket, q = 1) decode graph over the same input
buffers. The accepted counts and next tokens come from the device's greedy verification of the
step (ops/step's accept_drafts); this op turns the verify's buffers (q rows per sequence) into the
decode's (one row per sequence):

  live sequence b < num_seqs:   p = seq_lens[b] - q + accepted[b] + 1   (seq_lens[b]: p0 + q)
                                input id next_token[b], position p, slot table[b, p // bs] * bs
                                + p % bs, context p + 1
  padding sequence b < bucket:  position 0, slot -1 (no KV written), context 1
  query starts:                 b for b in 0..bucket (one row per sequence)

Each sequence reads and writes only its own index, so the kernel needs no ordering between
sequences. The block table stays as it is: the caller checked that each sequence's furthest
possible position lies in the blocks it holds.

verify_to_decode_inputs_torch is the twin (what runs off CUDA, and what the Triton kernel,
triton_verify_to_decode.py, is held to by tests/ops/test_step_verify_to_decode.py);
verify_to_decode_inputs chooses.
"""

from __future__ import annotations

import torch

from foretell.ops.common import kernel_choice


def verify_to_decode_inputs_torch(
    input_ids: torch.Tensor,  # [>= bucket * q] int64, written (first bucket)
    positions: torch.Tensor,  # [>= bucket * q] int64, written (first bucket)
    slot_mapping: torch.Tensor,  # [>= bucket * q] int64, written (first bucket)
    seq_lens: torch.Tensor,  # [>= bucket] int32: read (the verify's contexts), then written
    query_start_loc: torch.Tensor,  # [>= bucket + 1] int32, written
    table: torch.Tensor,  # [>= num_seqs, W] int32: the blocks the buffers hold
    accepted: torch.Tensor,  # [>= num_seqs] int64: drafts each sequence accepted
    next_token: torch.Tensor,  # [>= num_seqs] int64: the target's token after them
    num_seqs: int,
    bucket: int,
    q: int,
    block_size: int,
) -> None:
    n = num_seqs
    new_positions = seq_lens[:n].to(torch.int64) - q + accepted[:n] + 1  # [n]
    blocks = table[:n].gather(1, (new_positions // block_size)[:, None]).squeeze(1).to(torch.int64)  # [n]
    input_ids[:n].copy_(next_token[:n])
    positions[:n].copy_(new_positions)
    slot_mapping[:n].copy_(blocks * block_size + new_positions % block_size)
    seq_lens[:n].copy_(new_positions + 1)
    positions[n:bucket].fill_(0)
    slot_mapping[n:bucket].fill_(-1)
    seq_lens[n:bucket].fill_(1)
    query_start_loc[: bucket + 1].copy_(torch.arange(bucket + 1, dtype=query_start_loc.dtype,
                                                     device=query_start_loc.device))


def verify_to_decode_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    table: torch.Tensor,  # rows contiguous
    accepted: torch.Tensor,
    next_token: torch.Tensor,
    num_seqs: int,
    bucket: int,
    q: int,
    block_size: int,
    launches: dict | None = None,
) -> None:
    """A verify step's graph inputs (q rows for each of num_seqs sequences, in a graph of `bucket`)
    turned into the next plain decode step's (module docstring; shapes: the twin's). `launches`: a
    dict the caller keeps for the Triton launch's compiled kernel (direct launches after the
    first). Called by the runner alone on its own buffers: nothing is checked here."""
    args = (input_ids, positions, slot_mapping, seq_lens, query_start_loc, table, accepted, next_token, num_seqs,
            bucket, q, block_size)
    if kernel_choice.use_triton(input_ids, accepted):
        from foretell.ops.step import triton_verify_to_decode  # imports triton: CUDA only

        triton_verify_to_decode.verify_to_decode_inputs_triton(*args, launches)
        return
    verify_to_decode_inputs_torch(*args)
