"""A grammar's token bitmask applied to logits rows in one Triton launch (issue 27).

Twin: structured/bitmask.apply_token_bitmask's torch form (an unpack of the packed words, a masked
fill and, with a fallback, nan_to_num / isfinite / any / where and a copy back: about a dozen
kernels, each a launch on the host; the times: docs/perf-log.md, "twenty-third GPU session").

One program per masked row, the vocabulary in BLOCK-wide chunks; bit t of a row (word t // 32,
bit t % 32) allows token t, tokens past the row's words are forbidden:
  - without a fallback: the row's forbidden logits become -inf (one pass);
  - with a fallback (the logits before the other controls): a first pass asks whether any allowed
    logit is alive (not NaN, not -inf: +inf counts, as nan_to_num makes it the largest float), the
    second writes the allowed logits with NaN -> -inf and +inf -> the largest float when one is,
    else the fallback row's allowed logits as they are; forbidden ones -inf either way.
The same values as the twin, bit for bit (a select and two constant substitutions, no arithmetic).
Grids depend only on shapes: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # logits a program handles per chunk


@triton.jit
def _allowed(mask_row_ptr, cols, vocab, num_words):
    """[BLOCK] bool: whether the row's mask allows each column (False past the vocab or the words)."""
    words = cols >> 5
    inside = (cols < vocab) & (words < num_words)
    packed = tl.load(mask_row_ptr + words, mask=inside, other=0)
    return inside & (((packed >> (cols & 31)) & 1) != 0)


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [num_rows, vocab] float32, changed in place
    row_index_ptr,  # [m] int64: the logits row of mask row i (read with HAS_ROW_INDEX)
    mask_ptr,  # [m, num_words] int32, contiguous
    fallback_ptr,  # [num_rows, vocab] (read with HAS_FALLBACK)
    first_row,  # the logits row of mask row 0 without HAS_ROW_INDEX (a slice's start)
    vocab,
    num_words,
    stride_logits,
    stride_fallback,
    HAS_ROW_INDEX: tl.constexpr,
    HAS_FALLBACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    if HAS_ROW_INDEX:
        row = tl.load(row_index_ptr + i).to(tl.int64)
    else:
        row = (first_row + i).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    mask_row = mask_ptr + i.to(tl.int64) * num_words
    float_max = 3.4028234663852886e38
    if HAS_FALLBACK:
        alive = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            allowed = _allowed(mask_row, cols, vocab, num_words)
            v = tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf"))
            alive |= (allowed & (v == v) & (v != float("-inf"))).to(tl.int32)
        any_alive = tl.max(alive, axis=0) > 0
        fallback_row = fallback_ptr + row * stride_fallback
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_vocab = cols < vocab
            allowed = _allowed(mask_row, cols, vocab, num_words)
            if any_alive:
                v = tl.load(logits_row + cols, mask=in_vocab, other=0.0)
                v = tl.where(v != v, float("-inf"), tl.where(v == float("inf"), float_max, v))
            else:
                v = tl.load(fallback_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
            tl.store(logits_row + cols, tl.where(allowed, v, float("-inf")), mask=in_vocab)
    else:
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            allowed = _allowed(mask_row, cols, vocab, num_words)
            # forbidden logits only are written: the allowed ones stay as they are (NaN included)
            tl.store(logits_row + cols, tl.full([BLOCK], float("-inf"), tl.float32),
                     mask=(cols < vocab) & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor,  # [num_rows, vocab] float32, unit column stride, changed in place
    row_index: torch.Tensor | slice | None,  # [m] int64 or a step-1 slice, or None: every row
    bitmask: torch.Tensor,  # [m, words] int32 on logits' device
    fallback: torch.Tensor | None = None,  # [num_rows, vocab], unit column stride
) -> None:
    """structured/bitmask.apply_token_bitmask in one launch (module docstring)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] float32 with a unit column stride, got {logits.dtype} "
                         f"{list(logits.shape)} strides {logits.stride()}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [rows, words] int32, got {bitmask.dtype} {list(bitmask.shape)}")
    bitmask = bitmask.contiguous()
    m = bitmask.shape[0]
    first_row = 0
    if isinstance(row_index, slice):
        first_row, stop, step = row_index.indices(logits.shape[0])
        if step != 1 or stop - first_row != m:
            raise ValueError(f"a slice of rows must have step 1 and {m} rows (one per mask row), got {row_index}")
        row_index = None
    elif row_index is None and m != logits.shape[0]:
        raise ValueError(f"{m} mask rows for {logits.shape[0]} logits rows: give the rows they are for")
    elif isinstance(row_index, torch.Tensor) and row_index.shape != (m,):
        raise ValueError(f"row_index must be [{m}] (one per mask row), got {list(row_index.shape)}")
    if fallback is not None and (fallback.shape != logits.shape or fallback.stride(1) != 1):
        raise ValueError(f"fallback must be {list(logits.shape)} with a unit column stride, got "
                         f"{list(fallback.shape)} strides {fallback.stride()}")
    if m == 0:
        return
    has_index = isinstance(row_index, torch.Tensor)
    _apply_bitmask_kernel[(m,)](
        logits, row_index if has_index else bitmask, bitmask, fallback if fallback is not None else logits,
        first_row, logits.shape[1], bitmask.shape[1], logits.stride(0),
        (fallback if fallback is not None else logits).stride(0),
        HAS_ROW_INDEX=has_index, HAS_FALLBACK=fallback is not None, BLOCK=BLOCK, num_warps=4,
    )
