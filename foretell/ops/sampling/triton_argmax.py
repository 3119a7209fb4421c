"""Row-wise argmax over a large vocabulary in two Triton kernels.

torch.argmax runs one thread block per row, so in a batch-1 decode step (one row of 102k-152k
logits) one SM reads the whole 0.5 MB row (its H200 time: docs/perf-log.md). Here the row is cut
into chunks:
  1. grid (rows, chunks): each program finds its chunk's maximum and the first column holding it;
  2. grid (rows,): each program picks the first chunk with the row's maximum, hence the first
     column overall, which is torch.argmax's tie rule.
NaN counts as +inf (torch.argmax returns a NaN's position; here a NaN ties with +inf).

Twin: torch.argmax(dim=-1). tests/ops/test_sampling_argmax.py holds them together in Triton's
interpreter; the grids depend only on shapes, so both launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foretell.ops.common.pdl import join_dependent_chain, launch_options, pdl_enabled

CHUNK = 4096  # columns per program in the first kernel


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,  # [rows, vocab]
    chunk_max_ptr,  # [rows, num_chunks] float32 out
    chunk_arg_ptr,  # [rows, num_chunks] int32 out: a column index of the row
    vocab,
    num_chunks,
    stride_row,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)  # the logits come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
    values = values.to(tl.float32)
    values = tl.where(values != values, float("inf"), values)  # NaN -> +inf
    best = tl.max(values, axis=0)
    first = tl.min(tl.where(values == best, cols, vocab), axis=0)  # first column holding best
    tl.store(chunk_max_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_arg_ptr + row * num_chunks + chunk, first)


@triton.jit
def _pick_chunk_kernel(
    chunk_max_ptr,  # [rows, num_chunks] float32
    chunk_arg_ptr,  # [rows, num_chunks] int32
    out_ptr,  # [rows] int64 out, rows stride_out apart
    id_map_ptr,  # [vocab] int64 (read with HAS_MAP)
    num_chunks,
    stride_out,
    CHUNKS_P: tl.constexpr,
    HAS_MAP: tl.constexpr,  # write id_map[argmax] (an EAGLE3 draft id's target id)
    PDL: tl.constexpr,
):
    join_dependent_chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_P)
    valid = chunks < num_chunks
    best = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"))
    top = tl.max(best, axis=0)
    first_chunk = tl.min(tl.where(valid & (best == top), chunks, CHUNKS_P), axis=0)
    column = tl.load(chunk_arg_ptr + row * num_chunks + first_chunk).to(tl.int64)
    if HAS_MAP:
        column = tl.load(id_map_ptr + column)
    tl.store(out_ptr + row * stride_out, column)


def argmax_triton(
    logits: torch.Tensor, id_map: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [rows, vocab] (unit stride on vocab) -> [rows] int64, as torch.argmax(dim=-1), or
    id_map[argmax] with id_map [vocab] int64 (one launch fewer than indexing afterwards); written
    into `out` ([rows] int64, any stride: a column of a drafts buffer, say) when given."""
    if logits.dim() != 2 or logits.shape[-1] == 0 or logits.stride(-1) != 1:
        raise ValueError(
            f"argmax_triton needs logits [rows, vocab > 0] with a unit last stride; got shape "
            f"{tuple(logits.shape)}, stride {logits.stride()}"
        )
    if id_map is not None and (id_map.shape != logits.shape[-1:] or id_map.dtype != torch.int64
                               or not id_map.is_contiguous() or id_map.device != logits.device):
        raise ValueError(
            f"id_map must be a contiguous [{logits.shape[-1]}] int64 tensor on {logits.device}, got "
            f"{list(id_map.shape)} {id_map.dtype} on {id_map.device}"
        )
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or out.device != logits.device:
        raise ValueError(f"out must be a [{rows}] int64 tensor on {logits.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    pdl = pdl_enabled(logits)  # each launch starts behind the kernel before it (ops/common/pdl.py)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, chunk_max, chunk_arg, vocab, num_chunks, logits.stride(0), CHUNK=CHUNK, PDL=pdl, num_warps=8,
        **launch_options(pdl),
    )
    _pick_chunk_kernel[(rows,)](
        chunk_max, chunk_arg, out, id_map if id_map is not None else out, num_chunks, out.stride(0),
        CHUNKS_P=max(2, triton.next_power_of_2(num_chunks)), HAS_MAP=id_map is not None, PDL=pdl, num_warps=1,
        **launch_options(pdl),
    )
    return out
