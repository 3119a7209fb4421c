"""The inputs of one target forward, built once per step from the scheduler's decision.

Also records, per scheduled sequence, which rows of the forward feed the sampler: the last row
of a sequence that samples, or its last 1 + k rows when it carries k drafts to verify.

The batch holds its values as host lists and builds the device tensors (input ids, positions,
AttentionMetadata) at first use: a step that replays a CUDA graph never builds them, it packs the
lists into the graph's buffers with one copy (runner/graph_inputs.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.ops.attention.metadata import AttentionMetadata


@dataclass
class InputBatch:
    token_ids: list[int] | torch.Tensor  # [num_tokens]: host ids, or int64 on the device (decode ahead)
    position_list: list[int]  # [num_tokens]
    slot_list: list[int]  # [num_tokens]: the flat cache slot each row's K/V goes to
    block_ids: list[list[int]]  # per sequence: its cache blocks
    query_start: list[int]  # [num_seqs + 1]: sequence i owns rows query_start[i]:query_start[i + 1]
    seq_lens: list[int]  # per sequence: context length after this step's writes
    block_size: int
    device: torch.device
    logits_row_ids: list[int]  # rows of the forward to turn into logits, ascending
    sampling_seq_index: list[int]  # scheduled indices of the sequences that sample, in order
    row_positions: list[int]  # per logits row: position of the token that row predicts

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    # Cached: the batch does not change once built (a graph step asks for both more than once), and
    # build_decode_batch fills them in as it builds the lists.
    @functools.cached_property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    @functools.cached_property
    def block_table_width(self) -> int:
        return max((len(b) for b in self.block_ids), default=1) or 1

    @property
    def every_row_samples(self) -> bool:
        """Whether the logits rows are all the rows (each listed once, in order): a decode step."""
        return len(self.logits_row_ids) == self.num_tokens

    @functools.cached_property
    def input_ids(self) -> torch.Tensor:  # [num_tokens] int64 on the device
        if isinstance(self.token_ids, torch.Tensor):
            return self.token_ids
        return to_device(self.token_ids, torch.int64, self.device)

    @functools.cached_property
    def positions(self) -> torch.Tensor:  # [num_tokens] int64 on the device
        return to_device(self.position_list, torch.int64, self.device)

    @functools.cached_property
    def logits_rows(self) -> torch.Tensor:  # [num_logits_rows] int64 on the device
        return to_device(self.logits_row_ids, torch.int64, self.device)

    @functools.cached_property
    def attn_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=to_device(self.query_start, torch.int32, self.device),
            seq_lens=to_device(self.seq_lens, torch.int32, self.device),
            block_table=build_block_table(self.block_ids, self.device),
            slot_mapping=to_device(self.slot_list, torch.int64, self.device),
            block_size=self.block_size,
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
            query_start_loc_cpu=self.query_start,
            seq_lens_cpu=self.seq_lens,
        )


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of a sequence's token at `position`."""
    return block_ids[position // block_size] * block_size + position % block_size


def padded_block_rows(block_ids: list[list[int]], width: int | None = None) -> list[list[int]]:
    """Each sequence's blocks padded with block 0 to `width` (default: the longest)."""
    width = width or max((len(b) for b in block_ids), default=1) or 1
    return [b + [0] * (width - len(b)) for b in block_ids]


def build_block_table(block_ids: list[list[int]], device: torch.device) -> torch.Tensor:
    rows = padded_block_rows(block_ids)
    return to_device(rows, torch.int32, device).view(len(block_ids), len(rows[0]) if rows else 1)


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
    return InputBatch(
        token_ids=input_ids,
        position_list=positions,
        slot_list=slots,
        block_ids=[list(s.seq.block_ids) for s in scheduled],  # as they are now
        query_start=query_start,
        seq_lens=seq_lens,
        block_size=block_size,
        device=device,
        logits_row_ids=logits_rows,
        sampling_seq_index=sampling_seq_index,
        row_positions=row_positions,
    )


class DeferredInputBatch(InputBatch):
    """build_input_batch(scheduled, block_size, device), built at the first read of any field but
    `device` and `block_size` (every field and property reads as the built batch's from then on).

    The runner hands the scheduler's batch to the step kinds before knowing which one runs it: the
    padded verify of a host drafter's drafts of unequal lengths builds its own padded batch and
    reads only `device` here, so the batch is never built on that path (it was built twice)."""

    def __init__(self, scheduled: list[ScheduledSequence], block_size: int, device: torch.device):
        # no dataclass __init__: the fields arrive with the build (_build)
        self._scheduled = scheduled
        self.block_size = block_size
        self.device = device

    def __getattr__(self, name: str):
        """Reached only for what the instance lacks: a field before the build."""
        if name.startswith("__") or "_scheduled" not in vars(self):
            raise AttributeError(name)
        self._build()
        return getattr(self, name)

    def _build(self) -> None:
        built = build_input_batch(self._scheduled, self.block_size, self.device)
        del self._scheduled
        vars(self).update(vars(built))

    @property
    def is_built(self) -> bool:
        return "_scheduled" not in vars(self)


def build_decode_batch(
    seqs: list[Sequence],
    positions: list[int],  # per sequence: the position of its one input token
    input_ids: torch.Tensor,  # [num_seqs] int64 on the device (tokens not yet seen by the host)
    block_size: int,
) -> InputBatch:
    """A decode step (one row per sequence, every one sampling) whose input tokens are already on
    the device: what runner/decode_ahead.py launches before the host has read them."""
    n = len(seqs)
    rows = list(range(n))
    slots, block_ids, width = [], [], 1
    for seq, p in zip(seqs, positions):  # one pass: every plain decode step queued ahead builds this
        blocks = seq.block_ids
        slots.append(blocks[p // block_size] * block_size + p % block_size)  # cache_slot
        block_ids.append(list(blocks))  # as they are now
        width = max(width, len(blocks))
    next_positions = [p + 1 for p in positions]
    batch = InputBatch(
        token_ids=input_ids,
        position_list=positions,
        slot_list=slots,
        block_ids=block_ids,
        query_start=list(range(n + 1)),
        seq_lens=next_positions,
        block_size=block_size,
        device=input_ids.device,
        logits_row_ids=rows,
        sampling_seq_index=rows,
        row_positions=next_positions,  # (read only, like seq_lens: one list for both)
    )
    batch.max_query_len, batch.block_table_width = 1, width  # the cached properties, known here
    return batch


def rows_within(batch: InputBatch, max_model_len: int) -> InputBatch:
    """The batch with every row past max_model_len (a padded row of a sequence near the limit)
    rotated at the last position instead: the rotary tables may end there. Its K/V slot stays the
    row's own (a lookahead slot of the sequence, overwritten before anything reads it), and
    causality comes from the lengths, not the positions; its outputs are never used (acceptance
    stops before a padded row), and the draft loop clamps its own rows the same way
    (ops/step dispatch.catch_up_inputs)."""
    last = max_model_len - 1
    if max(batch.position_list, default=0) <= last:
        return batch
    return replace(batch, position_list=[min(p, last) for p in batch.position_list])
