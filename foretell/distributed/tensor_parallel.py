"""TensorParallel: one rank's place in a tensor-parallel group and the collectives layers call.

A model gets it through ModelOptions.tensor_parallel and hands it to every layer that splits its
weights; nothing reads it from a global. The single-rank instance (TensorParallel(), the
default) makes every collective return its input untouched, and the layers built with it are
the ordinary unsplit ones (they check `is_parallel` once, at construction).

Sizes are split the same way everywhere:
  even_shard(size)    size / world_size each, rank r holding [r * part, (r + 1) * part);
                      a size that does not divide raises (the model names the config field);
  padded_shard(size)  ceil(size / world_size) each (the vocabulary: the last ranks may hold
                      padding rows), rank r holding [r * part, min((r + 1) * part, size)).

The greedy pick over a vocabulary split across ranks needs no gather of the logits: each rank
sends its row maxima and their ids ([num_rows, 2] numbers), and every rank picks the same
winner over all ranks, ties going to the lowest token id as torch.argmax does on the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None with one rank

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"tensor-parallel world_size must be an integer >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.world_size > 1 and self.group is None:
            raise ValueError(
                f"a tensor-parallel group of {self.world_size} ranks needs its process group "
                f"(distributed/process_group.py: start_tensor_parallel)"
            )

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------------- splitting sizes

    def even_shard(self, size: int, what: str = "size") -> tuple[int, int]:
        """(start, part) of this rank's share of `size` split evenly; `what` names the size in
        the error (e.g. "num_attention_heads (from config.json)")."""
        if size % self.world_size:
            raise ValueError(
                f"{what} = {size} is not divisible by tensor_parallel_size = {self.world_size}; "
                f"choose a tensor_parallel_size that divides it"
            )
        part = size // self.world_size
        return self.rank * part, part

    def padded_shard(self, size: int) -> tuple[int, int, int]:
        """(start, rows this rank holds (padded), real rows among them) for a size split in
        ceil(size / world_size) parts."""
        part = -(-size // self.world_size)
        start = self.rank * part
        return start, part, max(0, min(part, size - start))

    # ----------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place; the input itself with one rank."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor (same shape on all) concatenated along dim, in rank order."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def greedy_argmax(
        self,
        local_logits: torch.Tensor,  # [num_rows, local_vocab]: this rank's real columns only
        vocab_start: int,  # the token id of this rank's column 0
    ) -> torch.Tensor:  # [num_rows] int64 token ids, the same on every rank
        """argmax over the whole vocabulary from each rank's columns, without gathering them:
        the maxima and their ids travel (as float64, exact for float32 values and for ids below
        2**53), the global pick takes the largest value and, among equal ones, the lowest id."""
        if self.world_size == 1:
            return local_logits.argmax(dim=-1) + vocab_start
        num_rows, local_vocab = local_logits.shape
        if local_vocab == 0:  # a rank holding only padding rows never wins
            values = local_logits.new_full((num_rows,), float("-inf"), dtype=torch.float64)
            ids = torch.zeros(num_rows, dtype=torch.float64, device=local_logits.device)
        else:
            values, ids = local_logits.max(dim=-1)  # the first maximum within the rank
            values, ids = values.double(), (ids + vocab_start).double()
        candidates = torch.stack((values, ids), dim=-1)  # [num_rows, 2]
        every = self.all_gather(candidates.unsqueeze(0), dim=0)  # [world_size, num_rows, 2]
        best = every[..., 0].max(dim=0).values  # [num_rows]
        # Ranks hold increasing ids, so the lowest rank holding the maximum holds its lowest id.
        winner = (every[..., 0] == best).int().argmax(dim=0)  # [num_rows]: first True
        return every[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()
