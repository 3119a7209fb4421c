"""The tensors of one target forward, built once per step from the scheduler's decision.

Also records, per scheduled sequence, which rows of the forward feed the sampler: the last row
of a sequence that samples, or its last 1 + k rows when it carries k drafts to verify.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.layers.attention.metadata import AttentionMetadata


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_row_ids: list[int]  # rows of the forward to turn into logits, ascending
    sampling_seq_index: list[int]  # scheduled indices of the sequences that sample, in order
    row_positions: list[int]  # per logits row: position of the token that row predicts
    query_start: list[int]  # per scheduled sequence: its first row

    @property
    def every_row_samples(self) -> bool:
        """Whether the logits rows are all the rows (each listed once, in order): a decode step."""
        return len(self.logits_row_ids) == self.input_ids.numel()

    @functools.cached_property
    def logits_rows(self) -> torch.Tensor:  # [num_logits_rows] int64 on the device, at first use
        return to_device(self.logits_row_ids, torch.int64, self.input_ids.device)


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


def build_block_table(block_ids: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(b) for b in block_ids), default=1) or 1
    rows = [b + [0] * (width - len(b)) for b in block_ids]
    return to_device(rows, torch.int32, device).view(len(block_ids), width)


def _attention_metadata(
    query_start: list[int],
    seq_lens: list[int],
    block_ids: list[list[int]],
    slots: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=to_device(query_start, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_table=build_block_table(block_ids, device),
        slot_mapping=to_device(slots, torch.int64, device),
        block_size=block_size,
        max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens,
    )


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
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(cache_slot(seq.block_ids, pos, block_size))
        row0 = query_start[-1]
        query_start.append(row0 + n)
        seq_lens.append(start + n)
        if item.samples:
            k = len(item.draft_token_ids)
            sampling_seq_index.append(i)
            for r in range(n - k - 1, n):
                logits_rows.append(row0 + r)
                row_positions.append(start + r + 1)
    metadata = _attention_metadata(
        query_start, seq_lens, [s.seq.block_ids for s in scheduled], slots, block_size, device
    )
    return InputBatch(
        input_ids=to_device(input_ids, torch.int64, device),
        positions=to_device(positions, torch.int64, device),
        attn_metadata=metadata,
        logits_row_ids=logits_rows,
        sampling_seq_index=sampling_seq_index,
        row_positions=row_positions,
        query_start=query_start,
    )


def build_decode_batch(
    seqs: list[Sequence],
    positions: list[int],  # per sequence: the position of its one input token
    input_ids: torch.Tensor,  # [num_seqs] int64 on the device (tokens not yet seen by the host)
    block_size: int,
) -> InputBatch:
    """A decode step (one row per sequence, every one sampling) whose input tokens are already on
    the device: what runner/decode_ahead.py launches before the host has read them."""
    n = len(seqs)
    slots = [cache_slot(seq.block_ids, p, block_size) for seq, p in zip(seqs, positions)]
    rows = list(range(n))
    metadata = _attention_metadata(
        list(range(n + 1)), [p + 1 for p in positions], [s.block_ids for s in seqs], slots,
        block_size, input_ids.device,
    )
    return InputBatch(
        input_ids=input_ids,
        positions=to_device(positions, torch.int64, input_ids.device),
        attn_metadata=metadata,
        logits_row_ids=rows,
        sampling_seq_index=rows,
        row_positions=[p + 1 for p in positions],
        query_start=list(range(n + 1)),
    )
