"""The tensors of one target forward, built once per step from the scheduler's decision.

Also records, per scheduled sequence, which rows of the forward feed the sampler: the last row
of a sequence that samples, or its last 1 + k rows when it carries k drafts to verify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence
from foretell.layers.attention.metadata import AttentionMetadata


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_rows: torch.Tensor  # [num_logits_rows] int64, rows of the forward to turn into logits
    sampling_seq_index: list[int]  # scheduled indices of the sequences that sample, in order
    row_positions: list[int]  # per logits row: position of the token that row predicts
    query_start: list[int]  # per scheduled sequence: its first row


def build_block_table(block_ids: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(b) for b in block_ids), default=1) or 1
    rows = [b + [0] * (width - len(b)) for b in block_ids]
    return to_device(rows, torch.int32, device).view(len(block_ids), width)


def build_input_batch(
    scheduled: list[ScheduledSequence], block_size: int, device: torch.device
) -> InputBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    row_positions: list[int] = []
    sampling_seq_index: list[int] = []
    for i, item in enumerate(scheduled):
        seq = item.seq
        start = seq.num_computed_tokens
        n = item.num_new_tokens
        input_ids.extend(item.input_token_ids)
        blocks = seq.block_ids
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        row0 = query_start[-1]
        query_start.append(row0 + n)
        seq_lens.append(start + n)
        if item.samples:
            k = len(item.draft_token_ids)
            sampling_seq_index.append(i)
            for r in range(n - k - 1, n):
                logits_rows.append(row0 + r)
                row_positions.append(start + r + 1)
    metadata = AttentionMetadata(
        query_start_loc=to_device(query_start, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_table=build_block_table([s.seq.block_ids for s in scheduled], device),
        slot_mapping=to_device(slots, torch.int64, device),
        block_size=block_size,
        max_query_len=max(s.num_new_tokens for s in scheduled),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )
    return InputBatch(
        input_ids=to_device(input_ids, torch.int64, device),
        positions=to_device(positions, torch.int64, device),
        attn_metadata=metadata,
        logits_rows=to_device(logits_rows, torch.int64, device),
        sampling_seq_index=sampling_seq_index,
        row_positions=row_positions,
        query_start=query_start,
    )
