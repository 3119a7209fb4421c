"""The next plain decode step's graph inputs made from the last one's, on the device (issue 32).

A greedy decode step queued ahead (runner/decode_ahead.py) feeds each sequence the token the step
before it picked, one position further on. When the graph's input buffers still hold that step's
inputs (and the sequence's next position lies in a block of the table they hold), the next step's
inputs follow from them alone: input id = the last replay's argmax, position + 1, context + 1,
slot = table[pos // block_size] * block_size + pos % block_size. One launch on the device then
replaces the host's batch, pack, upload and unpack of the step (runner/cuda_graph.py's
advance_decode). The query starts, the padding sequences and the block table stay as they are.

advance_decode_inputs_torch is the twin (what runs off CUDA, and what the Triton kernel,
triton_decode_advance.py, is held to by tests/ops/test_step_decode_advance.py); advance_decode_inputs
chooses.
"""

from __future__ import annotations

import torch

from foretell.ops.common import kernel_choice


def advance_decode_inputs_torch(
    input_ids: torch.Tensor,  # [>= B] int64, written
    positions: torch.Tensor,  # [>= B] int64: read, then written
    slot_mapping: torch.Tensor,  # [>= B] int64, written
    seq_lens: torch.Tensor,  # [>= B] int32, written
    table: torch.Tensor,  # [B, W] int32: the blocks the buffers hold
    tokens: torch.Tensor,  # [B] int64: each sequence's next input token (the last replay's argmax)
    block_size: int,
) -> None:
    num_seqs = tokens.shape[0]
    new_positions = positions[:num_seqs] + 1  # [B]
    blocks = table.gather(1, (new_positions // block_size)[:, None]).squeeze(1).to(torch.int64)  # [B]
    slot_mapping[:num_seqs].copy_(blocks * block_size + new_positions % block_size)
    seq_lens[:num_seqs].copy_(new_positions + 1)
    input_ids[:num_seqs].copy_(tokens)
    positions[:num_seqs].copy_(new_positions)


def advance_decode_inputs(
    input_ids: torch.Tensor,  # [>= B] int64, written
    positions: torch.Tensor,  # [>= B] int64: read, then written
    slot_mapping: torch.Tensor,  # [>= B] int64, written
    seq_lens: torch.Tensor,  # [>= B] int32, written
    table: torch.Tensor,  # [B, W] int32 (rows contiguous)
    tokens: torch.Tensor,  # [B] int64
    block_size: int,
    launches: dict | None = None,
) -> None:
    """One decode step's inputs (one row per sequence) turned into the next one's: sequence b feeds
    tokens[b] at its position + 1. The caller guarantees that position lies within the blocks its
    table row holds. `launches`: a dict the caller keeps for the Triton launch's compiled kernel
    (direct launches after the first: triton_decode_advance.py). Called once a decode step, by
    the runner alone: the shapes are its own buffers', so nothing is checked here."""
    if kernel_choice.use_triton(input_ids, tokens):
        from foretell.ops.step import triton_decode_advance  # imports triton: CUDA only

        triton_decode_advance.advance_decode_inputs_triton(input_ids, positions, slot_mapping, seq_lens, table,
                                                           tokens, block_size, launches)
        return
    advance_decode_inputs_torch(input_ids, positions, slot_mapping, seq_lens, table, tokens, block_size)
