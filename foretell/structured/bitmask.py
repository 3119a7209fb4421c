"""Token bitmasks on the device: bit t of a row (word t // 32, bit t % 32, little-endian) says
whether token t may come next. Plain torch (one unpack, one masked fill), the same code on the
CPU and on CUDA; the host fills the packed rows (matcher.py) and one copy moves them.
"""

from __future__ import annotations

import torch


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [rows, words] int32 -> allowed [rows, vocab_size] bool (tokens past the words: False)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [rows, words * 32]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    row_index: torch.Tensor,  # [m] int64: the rows the masks are for
    bitmask: torch.Tensor,  # [m, words] int32, on logits' device
    fallback: torch.Tensor | None = None,  # [num_rows, vocab]: the logits before other controls
) -> None:
    """-inf at every token a row's mask does not allow. With fallback: a row that the other
    logits controls left with no finite allowed logit (an allow list or a bias that excludes
    every token the grammar allows, an overflowing penalty) takes the fallback's logits under the
    mask instead, so the token drawn always satisfies the grammar; +inf and NaN become the
    largest float and -inf there (softmax stays defined)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [m, vocab] bool
    masked = logits[row_index].masked_fill(~allowed, float("-inf"))  # [m, vocab]
    if fallback is not None:
        masked = masked.nan_to_num(nan=float("-inf"), posinf=torch.finfo(masked.dtype).max, neginf=float("-inf"))
        alive = torch.isfinite(masked).any(dim=1, keepdim=True)  # [m, 1]
        masked = torch.where(alive, masked, fallback[row_index].masked_fill(~allowed, float("-inf")))
    logits[row_index] = masked
