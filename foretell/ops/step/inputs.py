"""The plain data the step bookkeeping ops take and return (ops/step/): a packed step's layout,
a CUDA graph's input buffers, and the draft loop's catch-up and chained-step inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Where each value of a packed step sits (runner/graph_inputs.py describes the layout)."""

    bucket: int
    q: int
    num_seqs: int  # live sequences
    width: int  # block-table columns written
    ids_on_host: bool  # input ids packed at the end (else read from the batch's device tensor)

    @property
    def rows(self) -> int:
        return self.bucket * self.q

    @property
    def live_rows(self) -> int:
        return self.num_seqs * self.q

    @property
    def table_offset(self) -> int:
        return 2 * self.rows + 2 * self.bucket + 1

    @property
    def ids_offset(self) -> int:
        return self.table_offset + self.num_seqs * self.width

    @property
    def size(self) -> int:
        return self.ids_offset + (self.live_rows if self.ids_on_host else 0)


@dataclass
class GraphInputBuffers:
    """The persistent input buffers of a CudaGraphRunner (views of its tensors)."""

    input_ids: torch.Tensor  # [max_rows] int64
    positions: torch.Tensor  # [max_rows] int64
    slot_mapping: torch.Tensor  # [max_rows] int64
    query_start_loc: torch.Tensor  # [max_bucket + 1] int32
    seq_lens: torch.Tensor  # [max_bucket] int32
    block_table: torch.Tensor  # [max_bucket, max_blocks] int32


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
