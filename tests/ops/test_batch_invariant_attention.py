"""The batch-invariant attention backends (issue 23): a query row's output is the same bits whether it
is decoded alone, verified among k + 1 rows, prefilled in a chunk of any size, or batched with other
sequences in any order. Torch (ops/attention/batch_invariant.py: what the CPU runs) and the Triton
launch (ops/attention/triton_batch_invariant.py, in Triton's interpreter on a CPU machine, float32
and float16) both; each agrees with the reference backend within rounding. The MLA twin
(ops/mla/batch_invariant.py) likewise, against the reference's absorbed form.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.attention.batch_invariant import BatchInvariantTorchAttention
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.attention.reference import TorchAttentionBackend

DEVICE = "cuda" if HAS_CUDA else "cpu"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 4
SEQ_LENS = [37, 9, 70]  # each sequence's full context


def make_world(dtype, seed=0):
    """A paged cache holding every sequence's whole context, and every position's query."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(perm[start : start + count].tolist())
        start += count
    queries = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype) for n in SEQ_LENS]
    return cache.to(DEVICE), tables, [q.to(DEVICE) for q in queries]


def run(backend, world, segments):
    """segments: (sequence, first row, end row) in batch order; rows lo..hi-1 are this step's
    queries and the context after the step is hi. -> {(sequence, row): output [heads, dim]}."""
    cache, tables, queries = world
    width = max(len(t) for t in tables)
    query = torch.cat([queries[s][lo:hi] for s, lo, hi in segments])
    starts = [0]
    for _, lo, hi in segments:
        starts.append(starts[-1] + hi - lo)
    table = torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s, _, _ in segments], dtype=torch.int32)
    seq_lens = [hi for _, _, hi in segments]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE), slot_mapping=torch.zeros(len(query), dtype=torch.int64, device=DEVICE),
        block_size=BLOCK_SIZE, max_query_len=max(hi - lo for _, lo, hi in segments), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    out = backend.attend(query, cache, metadata, HEAD_DIM**-0.5)
    rows = [(s, r) for s, lo, hi in segments for r in range(lo, hi)]
    return {key: out[i].cpu() for i, key in enumerate(rows)}


FORMATIONS = [
    [(0, 0, 37), (1, 0, 9), (2, 0, 70)],  # whole prefills together
    [(2, 0, 33), (0, 0, 16), (1, 0, 9)],  # chunks, another order
    [(0, 16, 20), (2, 33, 37), (1, 0, 1)],  # verify-sized steps
    [(2, 37, 70), (0, 20, 37), (1, 1, 9)],
    [(1, 4, 5), (0, 36, 37), (2, 69, 70)],  # decodes
]


ALONE = [[(s, r, r + 1)] for s in range(3) for r in (0, 5, 8)]  # rows decoded alone
# Triton's interpreter runs tl.dot through numpy, whose float32 matmul rounds a row by its position
# in the tile (a GPU's MMA treats rows alike); there, rows keep their tile slot: chunks start at
# multiples of the launch's 8 query rows and rows alone are those at a multiple of 8.
ALIGNED = [
    [(0, 0, 37), (1, 0, 9), (2, 0, 70)],
    [(2, 0, 32), (0, 0, 16), (1, 0, 9)],
    [(0, 16, 24), (2, 32, 40), (1, 8, 9)],
    [(2, 40, 70), (0, 24, 37)],
] + [[(s, r, r + 1)] for s, r in [(0, 0), (0, 8), (0, 32), (1, 0), (1, 8), (2, 0), (2, 8), (2, 64)]]


def assert_formations_agree(backend, world, formations=FORMATIONS + ALONE) -> dict:
    seen: dict = {}
    for segments in formations:
        for key, row in run(backend, world, segments).items():
            if key in seen:
                assert torch.equal(seen[key], row), f"sequence {key[0]} row {key[1]} differs in {segments}"
            else:
                seen[key] = row
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_rows_do_not_depend_on_their_step(dtype):
    world = make_world(dtype)
    got = assert_formations_agree(BatchInvariantTorchAttention(), world)
    want = run(TorchAttentionBackend(), world, FORMATIONS[0])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for key, row in want.items():
        assert torch.allclose(got[key].float(), row.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter's bf16 dot is broken
def test_triton_rows_do_not_depend_on_their_step(interpreter_mode, dtype):
    kernels = import_interpreted("foretell.ops.attention.triton_batch_invariant")
    world = make_world(dtype, seed=1)
    got = assert_formations_agree(kernels.BatchInvariantTritonAttention(), world,
                                  FORMATIONS + ALONE if HAS_CUDA else ALIGNED)
    want = run(TorchAttentionBackend(), world, FORMATIONS[0])
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    for key, row in want.items():
        assert torch.allclose(got[key].float(), row.float(), atol=tol, rtol=tol)


def test_triton_refuses_a_mismatched_block_size(interpreter_mode):
    kernels = import_interpreted("foretell.ops.attention.triton_batch_invariant")
    cache, tables, queries = make_world(torch.float32)
    metadata = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                 torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 8, 1, 1,
                                 [0, 1], [1])
    with pytest.raises(ValueError, match="paged with block_size 8"):
        kernels.BatchInvariantTritonAttention().attend(queries[0][:1], cache, metadata, 1.0)


# ------------------------------------------------------------------------------------- MLA


def test_mla_rows_do_not_depend_on_their_step():
    from foretell.ops.mla.batch_invariant import BatchInvariantTorchMLABackend
    from foretell.ops.mla.reference import TorchMLABackend

    gen = torch.Generator().manual_seed(2)
    heads, nope, rope, rank, v_dim, dtype = 4, 16, 8, 32, 16, torch.bfloat16
    n = 23
    cache = torch.randn(8, BLOCK_SIZE, rank + rope, generator=gen).to(dtype)  # [blocks, block, rank + rope]
    table = torch.randperm(8, generator=gen)[: -(-n // BLOCK_SIZE)].to(torch.int32)[None]  # [1, blocks]
    q_nope = torch.randn(n, heads, nope, generator=gen).to(dtype)
    q_pe = torch.randn(n, heads, rope, generator=gen).to(dtype)
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=gen) / rank**0.5).to(dtype)

    def attend(backend, lo, hi, **kw):
        metadata = AttentionMetadata(torch.tensor([0, hi - lo]), torch.tensor([hi]), table, torch.zeros(hi - lo),
                                     BLOCK_SIZE, hi - lo, hi, [0, hi - lo], [hi])
        return backend.attend(q_nope[lo:hi], q_pe[lo:hi], kv_b, cache, metadata, 0.1, v_dim, **kw)

    backend = BatchInvariantTorchMLABackend()
    whole = attend(backend, 0, n)
    for lo, hi in [(0, 5), (5, 9), (9, 23), (22, 23), (10, 11)]:
        assert torch.equal(attend(backend, lo, hi), whole[lo:hi]), (lo, hi)
    assert torch.allclose(whole.float(), attend(TorchMLABackend(), 0, n, absorb=True).float(), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="absorbed form"):
        attend(backend, 0, 2, absorb=False)
