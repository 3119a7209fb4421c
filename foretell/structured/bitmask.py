"""Token bitmasks on the device: bit t of a row (word t // 32, bit t % 32, little-endian) says
whether token t may come next. Plain torch (one unpack, one masked fill), the same code on the
CPU and on CUDA; the host fills the packed rows (matcher.py, batched_fill.py) into a reusable
BitmaskBuffer (pinned on CUDA) and one asynchronous copy moves them.
"""

from __future__ import annotations

import numpy as np
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
    row_index: torch.Tensor | None,  # [m] int64: the rows the masks are for (None: every row, m = num_rows)
    bitmask: torch.Tensor,  # [m, words] int32, on logits' device
    fallback: torch.Tensor | None = None,  # [num_rows, vocab]: the logits before other controls
) -> None:
    """-inf at every token a row's mask does not allow. With fallback: a row that the other
    logits controls left with no finite allowed logit (an allow list or a bias that excludes
    every token the grammar allows, an overflowing penalty) takes the fallback's logits under the
    mask instead, so the token drawn always satisfies the grammar; +inf and NaN become the
    largest float and -inf there (softmax stays defined)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [m, vocab] bool
    if row_index is None and fallback is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = logits if row_index is None else logits[row_index]  # [m, vocab]
    masked = rows.masked_fill(~allowed, float("-inf"))  # [m, vocab]
    if fallback is not None:
        masked = masked.nan_to_num(nan=float("-inf"), posinf=torch.finfo(masked.dtype).max, neginf=float("-inf"))
        alive = torch.isfinite(masked).any(dim=1, keepdim=True)  # [m, 1]
        fallback_rows = fallback if row_index is None else fallback[row_index]  # [m, vocab]
        masked = torch.where(alive, masked, fallback_rows.masked_fill(~allowed, float("-inf")))
    if row_index is None:
        logits.copy_(masked)
    else:
        logits[row_index] = masked


class BitmaskBuffer:
    """A reusable host buffer of packed mask rows and their copy to the device: pinned where the
    device is CUDA (the copy is then asynchronous; the next rows() waits for it before the host
    writes again), plain memory elsewhere. Grows to the most rows a step has asked for."""

    def __init__(self, num_words: int, device: torch.device):
        self.num_words = num_words
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host = torch.empty((0, num_words), dtype=torch.int32)  # [capacity, words]
        self._copied = None  # CUDA event after the last copy out of _host

    def rows(self, num_rows: int) -> np.ndarray:
        """[num_rows, words] int32 host rows to fill (their old contents are left as they were)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if num_rows > self._host.shape[0]:
            capacity = max(num_rows, 2 * self._host.shape[0])
            self._host = torch.empty((capacity, self.num_words), dtype=torch.int32, pin_memory=self.pinned)
        return self._host[:num_rows].numpy()

    def to_device(self, num_rows: int) -> torch.Tensor:
        """The first num_rows host rows on the device: [num_rows, words] int32."""
        host = self._host[:num_rows]
        if self.device.type == "cpu":
            return host.clone()  # the host rows are rewritten next step
        out = host.to(self.device, non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out
