"""Token bitmasks on the device: bit t of a row (word t // 32, bit t % 32, little-endian) says
whether token t may come next. Applied to logits in plain torch (an unpack, a masked fill) on the
CPU, and on CUDA in one Triton launch (ops/sampling/triton_token_bitmask.py, whose twin the torch
form is); the host fills the packed rows (matcher.py, batched_fill.py) into a reusable
BitmaskBuffer (pinned on CUDA) and one asynchronous copy moves them.
"""

from __future__ import annotations

import numpy as np
import torch

from foretell.ops.common.kernel_choice import use_triton


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [rows, words] int32 -> allowed [rows, vocab_size] bool (tokens past the words: False)."""
    return ~forbidden_tokens(bitmask, vocab_size)


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [rows, words] int32 -> forbidden [rows, vocab_size] bool: one shift, one and, one
    compare over the packed words (no separate negation: the caller's masked_fill takes it as is)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    forbidden = ((bitmask.unsqueeze(-1) >> shifts) & 1).eq(0).flatten(1)  # [rows, words * 32]
    if forbidden.shape[1] < vocab_size:
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab_size - forbidden.shape[1]), value=True)
    return forbidden[:, :vocab_size]


class TokenBits:
    """Where each token of a vocabulary sits in a packed mask row of target ids: its word and its
    bit, so that a drafter's forbidden tokens are one gather, one and and one compare over its
    own vocabulary (no [rows, target vocab] unpack, no index map applied after it)."""

    def __init__(
        self,
        target_ids: torch.Tensor | None,  # [vocab] int64: each token's target id (an EAGLE3 d2t), or None
        vocab_size: int,  # the logits' width (the same ids when target_ids is None)
        num_words: int,  # of the mask rows
        device: torch.device,
    ):
        self.source = target_ids  # what the entry was built from (TokenBitsCache compares it)
        ids = torch.arange(vocab_size, dtype=torch.int64) if target_ids is None else target_ids.to("cpu", torch.int64)
        inside = ids < num_words * 32  # tokens past the rows' words are never allowed
        words = torch.where(inside, ids >> 5, 0)  # [vocab] int64
        bits = torch.where(inside, torch.ones_like(ids) << (ids & 31), 0).to(torch.int32)  # [vocab]: 1 << 31 wraps
        self.host_words, self.host_bits = words.numpy(), bits.numpy()
        self.words, self.bits = words.to(device), bits.to(device)

    def forbidden(self, bitmask: torch.Tensor) -> torch.Tensor:
        """bitmask [rows, words] int32 -> forbidden [rows, vocab] bool."""
        return (bitmask.index_select(1, self.words) & self.bits).eq(0)

    def allows_any(self, row: np.ndarray) -> bool:
        """Whether the host row [words] int32 allows any token of this vocabulary."""
        return bool((row[self.host_words] & self.host_bits).any())


class TokenBitsCache:
    """The TokenBits of the vocabularies a runtime has met (a drafter's map and width), kept."""

    def __init__(self) -> None:
        self._entries: dict[tuple, TokenBits] = {}

    def get(self, target_ids: torch.Tensor | None, vocab_size: int, num_words: int, device: torch.device) -> TokenBits:
        key = (None if target_ids is None else id(target_ids), vocab_size, num_words, str(device))
        entry = self._entries.get(key)
        if entry is None or entry.source is not target_ids:  # an id reused by another tensor
            if len(self._entries) >= 8:
                self._entries.clear()
            entry = self._entries[key] = TokenBits(target_ids, vocab_size, num_words, device)
        return entry


def contiguous_rows(row_index: list[int]) -> slice | None:
    """The rows as one slice where they are consecutive (then the mask is applied in place on a
    view: no gather, scatter or index upload), else None."""
    if row_index and row_index == list(range(row_index[0], row_index[0] + len(row_index))):
        return slice(row_index[0], row_index[0] + len(row_index))
    return None


def apply_token_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    row_index: torch.Tensor | slice | None,  # [m] int64 or a slice: the rows the masks are for (None: every row)
    bitmask: torch.Tensor,  # [m, words] int32, on logits' device
    fallback: torch.Tensor | None = None,  # [num_rows, vocab]: the logits before other controls
) -> None:
    """-inf at every token a row's mask does not allow. With fallback: a row that the other
    logits controls left with no finite allowed logit (an allow list or a bias that excludes
    every token the grammar allows, an overflowing penalty) takes the fallback's logits under the
    mask instead, so the token drawn always satisfies the grammar; +inf and NaN become the
    largest float and -inf there (softmax stays defined). On CUDA (float32 logits and fallback)
    one Triton launch; else torch, where without fallback and with the rows a slice (or all of
    them) it is one in-place masked fill: four small kernels in all."""
    if (use_triton(logits, bitmask) and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
            and (fallback is None or (fallback.dtype == torch.float32 and fallback.stride(1) == 1))):
        from foretell.ops.sampling.triton_token_bitmask import apply_token_bitmask_triton  # imports triton

        apply_token_bitmask_triton(logits, row_index, bitmask, fallback)
        return
    forbidden = forbidden_tokens(bitmask, logits.shape[1])  # [m, vocab] bool
    if fallback is None and not isinstance(row_index, torch.Tensor):
        rows = logits if row_index is None else logits[row_index]  # [m, vocab], a view
        rows.masked_fill_(forbidden, float("-inf"))
        return
    if isinstance(row_index, slice):
        row_index = torch.arange(logits.shape[0], device=logits.device)[row_index]
    rows = logits if row_index is None else logits[row_index]  # [m, vocab]
    masked = rows.masked_fill(forbidden, float("-inf"))  # [m, vocab]
    if fallback is not None:
        masked = masked.nan_to_num(nan=float("-inf"), posinf=torch.finfo(masked.dtype).max, neginf=float("-inf"))
        alive = torch.isfinite(masked).any(dim=1, keepdim=True)  # [m, 1]
        fallback_rows = fallback if row_index is None else fallback[row_index]  # [m, vocab]
        masked = torch.where(alive, masked, fallback_rows.masked_fill(forbidden, float("-inf")))
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
