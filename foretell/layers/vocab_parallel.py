"""The token embedding and the output head with the vocabulary split over tensor-parallel ranks.

Each rank holds ceil(vocab_size / world_size) rows: rank r the token ids from r * rows on (the
last ranks' tail rows are zero padding past vocab_size). The embedding looks up the ids it holds,
writes zeros for the others, and sums over ranks. The head computes its logit columns; `forward`
gathers them into the whole [n, vocab_size] row (sampling, logprobs), `greedy_tokens` picks the
argmax with no gather (TensorParallel.greedy_argmax: ties go to the lowest id, as argmax over
the whole row does).

vocab_embedding / lm_head give the plain VocabEmbedding / LMHead for one rank, so a
single-device model is exactly today's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foretell.distributed.tensor_parallel import TensorParallel
from foretell.layers.embedding import LMHead, VocabEmbedding
from foretell.layers.rank_slices import RankSlice
from foretell.layers.weight_loaders import check_shape, make_param


class PaddedRowsLoader:
    """weight_loader for this rank's vocabulary rows: the first `real_rows` from the checkpoint
    (already cut by the loader through rank_slices), the padding rows after them zero."""

    def __init__(self, real_rows: int):
        self.real_rows = real_rows

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not fused but was given shard {shard_id!r}")
        check_shape(loaded, (self.real_rows, *param.shape[1:]), "this rank's vocabulary rows")
        with torch.no_grad():
            param[: self.real_rows].copy_(loaded.to(param.dtype))
            param[self.real_rows :].zero_()


def make_vocab_param(vocab_size: int, hidden_size: int, tp: TensorParallel, dtype, device) -> nn.Parameter:
    vocab_start, rows, real_rows = tp.padded_shard(vocab_size)
    param = make_param((rows, hidden_size), dtype, device)  # [vocab rows of this rank, hidden]
    param.weight_loader = PaddedRowsLoader(real_rows)
    param.rank_slices = {None: RankSlice(0, min(vocab_start, vocab_size), real_rows, vocab_size)}
    return param


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        nn.Module.__init__(self)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp = tp
        self.vocab_start, _, self.real_rows = tp.padded_shard(vocab_size)
        self.weight = make_vocab_param(vocab_size, hidden_size, tp, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        local_ids = input_ids - self.vocab_start  # [n]
        elsewhere = (local_ids < 0) | (local_ids >= self.real_rows)  # [n]: another rank's ids
        hidden = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)  # [n, hidden]
        hidden.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def extra_repr(self) -> str:
        return (f"{self.vocab_size}, {self.hidden_size}, rank {self.tp.rank} holds ids "
                f"[{self.vocab_start}, {self.vocab_start + self.real_rows})")


class ParallelLMHead(LMHead):
    """hidden -> float32 logits over a vocabulary split over ranks. With `tie_to`, this rank's rows
    of that VocabParallelEmbedding (the same Parameter)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        tie_to: VocabParallelEmbedding | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        nn.Module.__init__(self)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp = tp
        self.vocab_start, _, self.real_rows = tp.padded_shard(vocab_size)
        self.tied = tie_to is not None
        if tie_to is not None:
            if not isinstance(tie_to, VocabParallelEmbedding) or (
                    (tie_to.vocab_size, tie_to.hidden_size, tie_to.tp) != (vocab_size, hidden_size, tp)):
                raise ValueError(
                    f"cannot tie lm_head [{vocab_size}, {hidden_size}] split over "
                    f"{tp.world_size} ranks to {tie_to!r}"
                )
            self.weight = tie_to.weight
        else:
            self.weight = make_vocab_param(vocab_size, hidden_size, tp, dtype, device)
        self.num_gathers = 0  # forward calls, each an all-gather of whole rows (the runner reports it)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, real_rows] f32
        return super().forward(hidden)[:, : self.real_rows]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] f32
        self.num_gathers += 1
        every = self.tp.all_gather(super().forward(hidden), dim=-1)  # [n, world_size * rows]
        return every[:, : self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n] int64
        return self.tp.greedy_argmax(self.local_logits(hidden), self.vocab_start)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}, rank {self.tp.rank} "
                f"holds ids [{self.vocab_start}, {self.vocab_start + self.real_rows})")


def vocab_embedding(
    vocab_size: int, hidden_size: int, tp: TensorParallel, *, dtype=None, device=None,
) -> VocabEmbedding:
    if not tp.is_parallel:
        return VocabEmbedding(vocab_size, hidden_size, dtype=dtype, device=device)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp, dtype=dtype, device=device)


def lm_head(
    vocab_size: int, hidden_size: int, tp: TensorParallel, tie_to: VocabEmbedding | None = None,
    *, dtype=None, device=None,
) -> LMHead:
    if not tp.is_parallel:
        return LMHead(vocab_size, hidden_size, tie_to, dtype=dtype, device=device)
    return ParallelLMHead(vocab_size, hidden_size, tp, tie_to, dtype=dtype, device=device)
