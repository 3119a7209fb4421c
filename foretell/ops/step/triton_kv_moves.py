"""One launch that moves K/V rows between slots in every layer (ops/step/kv_moves.py has the
layout, the order argument and the torch twin). Imports triton: CUDA (or the interpreter tests) only.

Grid (layers x 2, sequences, column blocks): each program copies one column block of its
sequence's M moves in path order, in one layer's K or V plane. Entries whose source is their
destination (no move) are masked off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1024  # columns of a slot's row per program (Llama-8B: 8 KV heads x 128 = 1024)


@triton.jit(do_not_specialize=["num_seqs"])
def _move_kv_slots_kernel(
    base_ptr,  # the first layer's cache; every layer's plane is addressed from it
    layer_offsets_ptr,  # [num_layers] int64, elements from base_ptr
    src_ptr,  # [num_seqs * MOVES] int64
    dst_ptr,  # [num_seqs * MOVES] int64
    num_seqs,
    plane_elems,  # elements of one K (or V) plane: num_slots x row_elems
    row_elems,  # elements of one slot's row
    MOVES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    layer_kv = tl.program_id(0)
    seq = tl.program_id(1)
    layer = layer_kv // 2
    kv = (layer_kv % 2).to(tl.int64)
    plane = base_ptr + tl.load(layer_offsets_ptr + layer) + kv * plane_elems
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    first = seq.to(tl.int64) * MOVES
    for m in tl.static_range(MOVES):  # in path order: a write never lands on a later move's source
        src = tl.load(src_ptr + first + m)
        dst = tl.load(dst_ptr + first + m)
        moving = cols < tl.where(src != dst, row_elems, 0)  # in the row, and a real move
        row = tl.load(plane + src * row_elems + cols, mask=moving)
        tl.store(plane + dst * row_elems + cols, row, mask=moving)


def move_kv_slots_triton(targets, src_slots: torch.Tensor, dst_slots: torch.Tensor, moves_per_seq: int) -> None:
    num_seqs = src_slots.numel() // moves_per_seq
    if num_seqs == 0:
        return
    block = min(MAX_BLOCK, triton.next_power_of_2(targets.row_elems))
    grid = (2 * targets.num_layers, num_seqs, triton.cdiv(targets.row_elems, block))
    _move_kv_slots_kernel[grid](
        targets.views[0], targets.layer_offsets, src_slots, dst_slots, num_seqs,
        targets.num_slots * targets.row_elems, targets.row_elems, MOVES=moves_per_seq, BLOCK=block,
    )
