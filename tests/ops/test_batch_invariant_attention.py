"""The batch-invariant attention backends (issue 23): a query row's output is the same bits whether it
is decoded alone, verified among k + 1 rows, prefilled in a chunk of any size, or batched with other
sequences in any order. Torch (ops/attention/batch_invariant.py: what the CPU runs) and the Triton
launch (ops/attention/triton_batch_invariant.py, in Triton's interpreter on a CPU machine, float32
and float16) both; each agrees with the reference backend within rounding. The MLA twins
(ops/mla/batch_invariant.py in torch, ops/mla/batch_invariant_triton.py in Triton, attend and
attend_projections) likewise, against the reference's absorbed form.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.order_fixed_dot import order_fixed_dot  # noqa: F401  (a fixture: tl.dot summed in K order)
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
    query = torch.cat([queries[s][lo:hi] for s, lo, hi in segments])
    out = backend.attend(query, cache, step_metadata(tables, segments), HEAD_DIM**-0.5)
    rows = [(s, r) for s, lo, hi in segments for r in range(lo, hi)]
    return {key: out[i].cpu() for i, key in enumerate(rows)}


def step_metadata(tables, segments) -> AttentionMetadata:
    """The metadata of a step made of `segments` (run's), over block tables `tables`."""
    width = max(len(t) for t in tables)
    starts = [0]
    for _, lo, hi in segments:
        starts.append(starts[-1] + hi - lo)
    table = torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s, _, _ in segments], dtype=torch.int32)
    seq_lens = [hi for _, _, hi in segments]
    slots = [tables[s][r // BLOCK_SIZE] * BLOCK_SIZE + r % BLOCK_SIZE for s, lo, hi in segments for r in range(lo, hi)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_size=BLOCK_SIZE, max_query_len=max(hi - lo for _, lo, hi in segments), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    return metadata


FORMATIONS = [
    [(0, 0, 37), (1, 0, 9), (2, 0, 70)],  # whole prefills together
    [(2, 0, 33), (0, 0, 16), (1, 0, 9)],  # chunks, another order
    [(0, 16, 20), (2, 33, 37), (1, 0, 1)],  # verify-sized steps
    [(2, 37, 70), (0, 20, 37), (1, 1, 9)],
    [(1, 4, 5), (0, 36, 37), (2, 69, 70)],  # decodes
]


ALONE = [[(s, r, r + 1)] for s in range(3) for r in (0, 5, 8)]  # rows decoded alone
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
def test_triton_rows_do_not_depend_on_their_step(order_fixed_dot, dtype):
    """Every formation, rows in any tile slot: on a CPU through order_fixed_dot (the interpreter's
    numpy dot rounds a row by its slot in the tile; fixtures/order_fixed_dot.py)."""
    kernels = import_interpreted("foretell.ops.attention.triton_batch_invariant")
    world = make_world(dtype, seed=1)
    got = assert_formations_agree(kernels.BatchInvariantTritonAttention(), world, FORMATIONS + ALONE)
    want = run(TorchAttentionBackend(), world, FORMATIONS[0])
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    for key, row in want.items():
        assert torch.allclose(got[key].float(), row.float(), atol=tol, rtol=tol)


def make_raw_world(dtype, seed=0):
    """make_world's sequences before RoPE: every position's raw query, key and value heads, and an
    empty cache that a step's rope_attend fills with its own rows."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(perm[start : start + count].tolist())
        start += count
    raw = [tuple(torch.randn(n, heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
                 for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)) for n in SEQ_LENS]
    return cache.to(DEVICE), tables, raw


def run_rope(backend, world, segments, rotary, qk_norm, fused=True):
    """run's formations through the layer's entry point: the step's raw rows rotated (after
    qk_norm), written to the cache, attended. fused: backend.rope_attend, else the modules one after
    the other (norm_and_rotate, write_kv, attend: what the mode ran before rope_attend)."""
    from foretell.layers.attention.layer import norm_and_rotate

    cache, tables, raw = world
    query, key, value = (torch.cat([raw[s][i][lo:hi] for s, lo, hi in segments]) for i in range(3))
    positions = torch.tensor([r for _, lo, hi in segments for r in range(lo, hi)], device=DEVICE)
    metadata = step_metadata(tables, segments)
    if fused:
        out = backend.rope_attend(positions, query, key, value, rotary, cache, metadata, HEAD_DIM**-0.5, qk_norm)
    else:
        query, key = norm_and_rotate(positions, query, key, rotary, qk_norm)
        backend.write_kv(key, value, cache, metadata.slot_mapping)
        out = backend.attend(query, cache, metadata, HEAD_DIM**-0.5)
    rows = [(s, r) for s, lo, hi in segments for r in range(lo, hi)]
    return {row: out[i].cpu() for i, row in enumerate(rows)}


@pytest.mark.slow  # about 80 s each on 2 cores (the interpreter, an order-fixed dot)
@pytest.mark.parametrize(("dtype", "with_norms"), [(torch.float16, True), (torch.float32, False)],
                         ids=["float16_qwen3_norms", "float32_llama"])  # the interpreter's bf16 dot is broken
def test_triton_rope_attend_rows_do_not_depend_on_their_step(order_fixed_dot, dtype, with_norms):
    """BatchInvariantTritonAttention.rope_attend (RoPE + KV write in one launch, then the attention):
    a row's output is the same bits decoded alone, verified, in chunks of any size and batched in
    any order (every formation rewrites its rows' keys: the same bits again), and agrees within
    rounding with the modules one after the other."""
    from foretell.layers.norm import RMSNorm
    from foretell.layers.rotary import RotaryEmbedding

    kernels = import_interpreted("foretell.ops.attention.triton_batch_invariant")
    import_interpreted("foretell.ops.attention.triton_rope_kv")
    backend = kernels.BatchInvariantTritonAttention()
    assert backend.fuses_rope  # Attention.forward_rotary takes rope_attend
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None, "neox", device=DEVICE)
    qk_norm = None
    if with_norms:
        gen = torch.Generator().manual_seed(5)
        qk_norm = tuple(RMSNorm(HEAD_DIM, eps=1e-6, dtype=dtype, device=DEVICE) for _ in range(2))
        for norm in qk_norm:
            norm.weight.data.copy_(1.0 + 0.1 * torch.randn(HEAD_DIM, generator=gen))
    world = make_raw_world(dtype, seed=6)
    seen: dict = {}
    # Whole prefills (they write every row of every sequence), verify-sized steps, decodes, alone.
    for segments in [FORMATIONS[0], FORMATIONS[2], FORMATIONS[4], ALONE[1], ALONE[7]]:
        for row, out in run_rope(backend, world, segments, rotary, qk_norm).items():
            if row in seen:
                assert torch.equal(seen[row], out), f"sequence {row[0]} row {row[1]} differs in {segments}"
            else:
                seen[row] = out
    modules = run_rope(backend, make_raw_world(dtype, seed=6), FORMATIONS[0], rotary, qk_norm, fused=False)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    for row, out in modules.items():
        assert torch.allclose(seen[row].float(), out.float(), atol=tol, rtol=tol), row


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


# ------------------------------------------------------------------------------ MLA in Triton

SMALL_MLA = dict(heads=4, nope=16, rope=8, rank=32, v=16)


def make_mla_world(dtype, seed=0, dims=SMALL_MLA):
    """A latent cache holding every sequence's whole context ([c | k_pe] per token), every
    position's q (nope + rope) and fused kv_a rows, and kv_b_proj's weight (SEQ_LENS as the GQA
    world): (cache, tables, q, kv_a, kv_b, dims)."""
    heads, nope, rope, rank, v = (dims[k] for k in ("heads", "nope", "rope", "rank", "v"))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope, generator=gen).to(dtype)  # [blocks, block, rank + rope]
    perm = torch.randperm(num_blocks, generator=gen)
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(perm[start : start + count].tolist())
        start += count
    q = [torch.randn(n, heads, nope + rope, generator=gen).to(dtype).to(DEVICE) for n in SEQ_LENS]
    kv_a = [torch.randn(n, rank + rope, generator=gen).to(dtype).to(DEVICE) for n in SEQ_LENS]
    kv_b = (torch.randn(heads * (nope + v), rank, generator=gen) / rank**0.5).to(dtype).to(DEVICE)
    return cache.to(DEVICE), tables, q, kv_a, kv_b, dims


def run_mla(backend, world, segments, projections=False):
    """run's formations for an MLA backend: attend (q_nope, rotated q_pe given) or, with projections,
    attend_projections (norm + RoPE + cache write of the step's rows, then attend)."""
    from foretell.layers.norm import RMSNorm
    from foretell.layers.rotary import RotaryEmbedding

    cache, tables, q, kv_a, kv_b, dims = world
    metadata = step_metadata(tables, segments)
    rows = [(s, r) for s, lo, hi in segments for r in range(lo, hi)]
    q_step = torch.cat([q[s][lo:hi] for s, lo, hi in segments])  # [T, heads, nope + rope]
    if projections:
        norm = RMSNorm(dims["rank"], eps=1e-6).to(device=DEVICE, dtype=q_step.dtype)
        rotary = RotaryEmbedding(dims["rope"], 4096, 10000.0, None, "gptj", device=DEVICE)  # tables are not buffers: .to() leaves them
        positions = torch.tensor([r for _, r in rows], device=DEVICE)
        kv_step = torch.cat([kv_a[s][lo:hi] for s, lo, hi in segments])
        out = backend.attend_projections(q_step, kv_step, positions, rotary, norm, kv_b, cache, metadata, 0.2,
                                         dims["v"])
    else:
        nope = dims["nope"]
        out = backend.attend(q_step[..., :nope], q_step[..., nope:], kv_b, cache, metadata, 0.2, dims["v"])
    return {key: out[i].cpu() for i, key in enumerate(rows)}


def assert_mla_formations_agree(backend, world, formations, projections=False) -> dict:
    seen: dict = {}
    for segments in formations:
        for key, row in run_mla(backend, world, segments, projections).items():
            if key in seen:
                assert torch.equal(seen[key], row), f"sequence {key[0]} row {key[1]} differs in {segments}"
            else:
                seen[key] = row
    return seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter's bf16 dot is broken
def test_triton_mla_rows_do_not_depend_on_their_step(order_fixed_dot, dtype):
    """BatchInvariantTritonMLABackend (ops/mla/batch_invariant_triton.py): a row's output is the same
    bits decoded alone, verified, in chunks of any size and batched in any order; close to the
    float64 absorbed reference."""
    from foretell.ops.mla.reference import TorchMLABackend

    kernels = import_interpreted("foretell.ops.mla.batch_invariant_triton")
    world = make_mla_world(dtype, seed=3)
    got = assert_mla_formations_agree(kernels.BatchInvariantTritonMLABackend(), world, FORMATIONS + ALONE)
    cache, tables, q, kv_a, kv_b, dims = world
    wide = (cache.double(), tables, [t.double() for t in q], kv_a, kv_b.double(), dims)
    want = run_mla(TorchMLABackend(), wide, FORMATIONS[0])
    tol = 3e-3 if dtype == torch.float16 else 1e-5
    for key, row in want.items():
        assert torch.allclose(got[key].double(), row, atol=tol, rtol=tol), key
    with pytest.raises(ValueError, match="absorbed form"):
        nope = dims["nope"]
        kernels.BatchInvariantTritonMLABackend().attend(q[0][:1, :, :nope], q[0][:1, :, nope:], kv_b, cache,
                                                         step_metadata(tables, [(0, 0, 1)]), 0.2, dims["v"],
                                                         absorb=False)


def test_triton_mla_projections_rows_do_not_depend_on_their_step(order_fixed_dot):
    """attend_projections (latent norm, RoPE and cache write of the step's rows, absorbed query with
    its RoPE, attention, value projection): the same bits per row in every formation, float16."""
    kernels = import_interpreted("foretell.ops.mla.batch_invariant_triton")
    world = make_mla_world(torch.float16, seed=4)
    backend = kernels.BatchInvariantTritonMLABackend()
    formations = [FORMATIONS[0], FORMATIONS[2], FORMATIONS[4], ALONE[1]]  # the first writes every row
    assert_mla_formations_agree(backend, world, formations, projections=True)


def test_mla_dispatch_gives_the_triton_mode_its_kernels(interpreter_mode):
    from foretell.ops.mla.dispatch import build_mla_backend

    import_interpreted("foretell.ops.mla.batch_invariant_triton")
    backend = build_mla_backend("triton_batch_invariant")
    assert backend.name == "triton_batch_invariant" and backend.graph_safe
    assert build_mla_backend("torch_batch_invariant").name == "torch_batch_invariant"
