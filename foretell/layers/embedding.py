"""Token embedding and the output head (which may share the embedding's weight).

The head's matmul goes through a bound SmallMGemm like a Linear's (see layers/linear.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from foretell.layers.cpu_few_rows import few_rows_linear, fits_few_rows
from foretell.layers.weight_loaders import make_param

if TYPE_CHECKING:
    from foretell.ops.gemm.dispatch import SmallMGemm


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = make_param((vocab_size, hidden_size), dtype, device)  # [vocab, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


class LMHead(nn.Module):
    """hidden -> float32 logits. With `tie_to`, uses that embedding's weight (the same Parameter,
    so the model has no separate lm_head parameter and named_parameters lists it once)."""

    small_m: "SmallMGemm | None" = None  # as Linear.small_m

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tie_to: VocabEmbedding | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tied = tie_to is not None
        if tie_to is not None:
            if (tie_to.vocab_size, tie_to.hidden_size) != (vocab_size, hidden_size):
                raise ValueError(
                    f"cannot tie lm_head [{vocab_size}, {hidden_size}] to an embedding of "
                    f"[{tie_to.vocab_size}, {tie_to.hidden_size}]"
                )
            self.weight = tie_to.weight
        else:
            self.weight = make_param((vocab_size, hidden_size), dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] f32
        if self.small_m is not None:  # the kernels store float32 themselves (no cast launch)
            return self.small_m(hidden, self.weight, float32_out=True)
        if fits_few_rows(hidden, self.weight):  # a CPU verify's rows (cpu_few_rows.py); already float32
            return few_rows_linear(hidden, self.weight)
        logits = F.linear(hidden, self.weight)
        return logits if logits.dtype == torch.float32 else logits.float()  # (a no-op cast still costs a call)

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}, tied={self.tied}"
