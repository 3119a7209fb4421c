"""The draft vocabulary: the N target tokens the head may propose.

The N most frequent tokens among the ones the target writes in the training data (loss-masked
tokens), ties broken by smaller id; when the data has fewer than N distinct tokens, the rest are
filled with the smallest unused ids so the head always has exactly N outputs. Stored sorted:
  used [N]          target id of each draft id, ascending
  d2t  [N] int64    d2t[i] = used[i] - i, so target_id = draft_id + d2t[draft_id]
  t2d  [V] bool     t2d[v] = v is in the draft vocabulary
N >= the target vocabulary gives the identity (d2t all zero, t2d all true).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.training.data import Example


@dataclass
class DraftVocab:
    used: torch.Tensor  # [draft_vocab] int64, ascending target ids

    @property
    def size(self) -> int:
        return int(self.used.numel())

    def d2t(self) -> torch.Tensor:  # [draft_vocab] int64
        return self.used - torch.arange(self.size, dtype=torch.int64)

    def t2d(self, target_vocab: int) -> torch.Tensor:  # [target_vocab] bool
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[self.used] = True
        return t2d


def build_draft_vocab(examples: list[Example], draft_vocab_size: int, target_vocab: int) -> DraftVocab:
    if draft_vocab_size < 1:
        raise ValueError(f"--draft-vocab-size must be >= 1, got {draft_vocab_size}")
    if draft_vocab_size >= target_vocab:
        return DraftVocab(torch.arange(target_vocab, dtype=torch.int64))
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    for e in examples:
        ids = torch.tensor(e.input_ids, dtype=torch.int64)
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)
        if int(ids.max()) >= target_vocab or int(ids.min()) < 0:
            raise ValueError(f"{e.source}: token id {int(ids.max())} is outside the target vocabulary [0, {target_vocab})")
        counts += torch.bincount(ids[mask], minlength=target_vocab)
    # Sort by count descending, then id ascending (stable sort over ids already ascending).
    order = torch.sort(-counts, stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values
    return DraftVocab(used)
