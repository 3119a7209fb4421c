"""A step's graph inputs in one copy and one launch (runner/graph_inputs.py): the packed array
unpacks into exactly the buffers a graph reads (live rows, padding sequences at positions 0 with
slot -1 and context q, block-table rows of the live sequences, input ids from the host or from a
device tensor), by the Triton kernel (in Triton's interpreter on the CPU) and by its torch twin."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.step import reference
from foretell.ops.step.inputs import GraphInputBuffers
from foretell.runner import graph_inputs
from foretell.runner.pinned_ring import PinnedRing
from foretell.runner.input_batch import InputBatch

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernel = import_interpreted("foretell.ops.step.triton_kernels")
MAX_BUCKET, MAX_ROWS, MAX_BLOCKS, BLOCK_SIZE = 8, 8 * 4, 6, 4


def _batch(rng: random.Random, n: int, q: int, ids_on_device: bool) -> InputBatch:
    block_ids, positions, slots, seq_lens = [], [], [], []
    for _ in range(n):
        context = rng.randint(q, MAX_BLOCKS * BLOCK_SIZE)
        blocks = rng.sample(range(100), -(-context // BLOCK_SIZE))
        block_ids.append(blocks)
        seq_lens.append(context)
        for p in range(context - q, context):
            positions.append(p)
            slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    tokens = [rng.randrange(1000) for _ in range(n * q)]
    return InputBatch(
        token_ids=torch.tensor(tokens, device=DEVICE) if ids_on_device else tokens,
        position_list=positions, slot_list=slots, block_ids=block_ids, query_start=list(range(0, n * q + 1, q)),
        seq_lens=seq_lens, block_size=BLOCK_SIZE, device=DEVICE, logits_row_ids=[], sampling_seq_index=[],
        row_positions=[],
    )


def _buffers() -> GraphInputBuffers:
    """Every buffer poisoned with 77, so what the unpack leaves alone shows."""
    def full(*shape, dtype):
        return torch.full(shape, 77, dtype=dtype, device=DEVICE)
    return GraphInputBuffers(full(MAX_ROWS, dtype=torch.int64), full(MAX_ROWS, dtype=torch.int64),
                             full(MAX_ROWS, dtype=torch.int64), full(MAX_BUCKET + 1, dtype=torch.int32),
                             full(MAX_BUCKET, dtype=torch.int32), full(MAX_BUCKET, MAX_BLOCKS, dtype=torch.int32))


def _expected(batch: InputBatch, bucket: int, q: int) -> GraphInputBuffers:
    out = _buffers()
    n, rows = batch.num_seqs, bucket * q
    out.input_ids[: n * q] = torch.as_tensor(batch.token_ids).to(DEVICE)
    out.positions[:rows] = torch.tensor(batch.position_list + [0] * (rows - n * q))
    out.slot_mapping[:rows] = torch.tensor(batch.slot_list + [-1] * (rows - n * q))
    out.seq_lens[:bucket] = torch.tensor(batch.seq_lens + [q] * (bucket - n), dtype=torch.int32)
    out.query_start_loc[: bucket + 1] = torch.arange(0, rows + 1, q, dtype=torch.int32)
    for i, blocks in enumerate(batch.block_ids):
        width = batch.block_table_width
        out.block_table[i, :width] = torch.tensor(blocks + [0] * (width - len(blocks)), dtype=torch.int32)
    return out


@pytest.mark.parametrize("from_ring", [False, True])
@pytest.mark.parametrize("ids_on_device", [False, True])
@pytest.mark.parametrize("n, bucket, q", [(1, 1, 1), (3, 4, 1), (5, 8, 4), (8, 8, 2)])
def test_unpack_fills_the_graph_buffers(n, bucket, q, ids_on_device, from_ring):
    seed = random.randrange(2**31)
    batch = _batch(random.Random(seed), n, q, ids_on_device)
    # A ring of tiny slots, already used: pack grows and overwrites its slot.
    ring = PinnedRing(torch.int64, torch.device("cpu"), numel=2, depth=2) if from_ring else None
    if ring is not None:
        ring.take(2)[0].fill_(-7)
        ring.take(2)[0].fill_(-7)
    host, layout, slot = graph_inputs.pack(batch, bucket, q, ring)
    assert host.dtype == torch.int64 and host.numel() == layout.size
    assert (slot is not None) == from_ring
    staging = host.to(DEVICE)
    tokens = staging[layout.ids_offset :] if layout.ids_on_host else batch.token_ids
    expected = _expected(batch, bucket, q)
    for unpack in (reference.unpack_graph_inputs_torch, kernel.unpack_graph_inputs_triton):
        got = _buffers()
        unpack(staging, tokens, got, layout)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), f"{unpack.__name__} {name} (seed {seed})"


def test_download_outputs_flattens_views_of_static_buffers():
    """A verify step's results leave as one host copy: accepted [n], next token [n] and the drafts,
    a transposed [n, k] view of the draft loop's [k, bucket] buffer, flattened row by row. The
    flattening copy is the side stream's own (on CUDA), so no temporary of the graph stream is
    freed while the side stream still reads it."""
    side = graph_inputs.SideStream(DEVICE)
    by_step = torch.arange(12, device=DEVICE).view(3, 4)  # [k, bucket]: draft j of sequence i at (j, i)
    drafts = by_step.t()[:2]  # [n = 2, k = 3], strided
    accepted = torch.tensor([1, 3], device=DEVICE)
    next_token = torch.tensor([7, 9], device=DEVICE)
    host, ready = side.download_outputs([accepted, next_token, drafts])
    if ready is not None:
        ready.synchronize()
    assert host.tolist() == [1, 3, 7, 9, 0, 4, 8, 1, 5, 9]


@pytest.mark.skipif(not HAS_CUDA, reason="the direct launch calls a compiled kernel's launcher: CUDA only")
def test_direct_launches_fill_the_graph_buffers_as_the_first():
    """unpack_graph_inputs_triton with a launch cache: the first launch compiles through Triton and
    keeps the kernel, later ones call its launcher directly; every step (sizes and token sources
    changing, token pointers at both alignments) fills the buffers as the reference does."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    launches: dict = {}
    for step in range(12):
        n, q = rng.choice([(1, 1), (3, 1), (5, 4), (8, 2), (2, 4)])
        bucket = next(b for b in (1, 2, 4, 8) if b >= n)
        batch = _batch(rng, n, q, ids_on_device=step % 3 == 0)
        host, layout, _ = graph_inputs.pack(batch, bucket, q)
        staging = host.to(DEVICE)
        tokens = staging[layout.ids_offset :] if layout.ids_on_host else batch.token_ids
        got = _buffers()
        kernel.unpack_graph_inputs_triton(staging, tokens, got, layout, launches)
        expected = _expected(batch, bucket, q)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), f"step {step} {name} (seed {seed})"
    assert launches, "no compiled kernel kept"
