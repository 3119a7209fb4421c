"""The verify-to-decode advance (ops/step/verify_to_decode.py): a host drafter's verify step's graph
inputs turned into the plain decode step's after it. The Triton kernel (in Triton's interpreter on
the CPU) and its torch twin are both held to a plain-Python reference on random verify buffers:
each live sequence feeds its next token one position past its accepted drafts, slots follow its
table row, padding sequences write no KV, query starts count one row per sequence, and nothing past
the graph's bucket changes."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.step.verify_to_decode import verify_to_decode_inputs, verify_to_decode_inputs_torch

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernel = import_interpreted("foretell.ops.step.triton_verify_to_decode")
MAX_SEQS, MAX_BLOCKS = 160, 6
NAMES = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "table")


def _buffers(rng: random.Random, q: int, block_size: int) -> dict:
    """Random buffers of a verify step of q rows per sequence: each sequence's context (seq_lens)
    leaves room in its table for the furthest decode position (all q - 1 drafts accepted)."""
    rows = MAX_SEQS * q

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return dict(
        input_ids=tensor([rng.randrange(50_000) for _ in range(rows)], torch.int64),
        positions=tensor([rng.randrange(5000) for _ in range(rows)], torch.int64),
        slot_mapping=tensor([rng.randrange(-1, 5000) for _ in range(rows)], torch.int64),
        seq_lens=tensor([rng.randrange(q, MAX_BLOCKS * block_size) for _ in range(MAX_SEQS)], torch.int32),
        query_start_loc=tensor([rng.randrange(5000) for _ in range(MAX_SEQS + 1)], torch.int32),
        table=tensor([[rng.randrange(1000) for _ in range(MAX_BLOCKS)] for _ in range(MAX_SEQS)], torch.int32),
    )


def _reference(buffers: dict, accepted: list[int], next_token: list[int], bucket: int, q: int,
               block_size: int) -> dict:
    """What the advance leaves, one sequence at a time in Python."""
    out = {name: t.tolist() for name, t in buffers.items()}
    for b in range(bucket):
        if b < len(accepted):
            pos = out["seq_lens"][b] - q + accepted[b] + 1
            out["input_ids"][b] = next_token[b]
            out["slot_mapping"][b] = out["table"][b][pos // block_size] * block_size + pos % block_size
        else:
            pos = 0
            out["slot_mapping"][b] = -1
        out["positions"][b] = pos
        out["seq_lens"][b] = pos + 1
    out["query_start_loc"][: bucket + 1] = list(range(bucket + 1))
    return out


def _run(advance, buffers: dict, accepted: torch.Tensor, next_token: torch.Tensor, bucket: int, q: int,
         block_size: int, **kwargs) -> dict:
    got = {name: t.clone() for name, t in buffers.items()}
    advance(*(got[name] for name in NAMES), accepted, next_token, accepted.shape[0], bucket, q, block_size, **kwargs)
    return {name: t.tolist() for name, t in got.items()}


def _case(rng: random.Random, num_seqs: int, q: int):
    accepted = torch.tensor([rng.randrange(q) for _ in range(num_seqs)], dtype=torch.int64, device=DEVICE)
    next_token = torch.tensor([rng.randrange(50_000) for _ in range(num_seqs)], dtype=torch.int64, device=DEVICE)
    return accepted, next_token


# (num_seqs, bucket): full buckets, padding sequences, 129+: two programs, the second one masked
@pytest.mark.parametrize("num_seqs,bucket", [(1, 1), (1, 2), (3, 4), (16, 16), (13, 16), (129, 136), (150, MAX_SEQS)])
@pytest.mark.parametrize("q,block_size", [(2, 1), (5, 4), (17, 16)])
def test_kernel_and_twin_equal_the_reference(num_seqs, bucket, q, block_size):
    rng = random.Random(num_seqs * 31 + bucket * 7 + q)
    buffers = _buffers(rng, q, block_size)
    accepted, next_token = _case(rng, num_seqs, q)
    expected = _reference(buffers, accepted.tolist(), next_token.tolist(), bucket, q, block_size)
    assert _run(verify_to_decode_inputs_torch, buffers, accepted, next_token, bucket, q, block_size) == expected
    assert _run(kernel.verify_to_decode_inputs_triton, buffers, accepted, next_token, bucket, q,
                block_size) == expected


def test_counts_and_tokens_may_be_views_of_longer_buffers():
    """The accepted counts and next tokens are the verifier's static buffers (longer than the batch)."""
    rng = random.Random(5)
    buffers = _buffers(rng, 4, 16)
    accepted, next_token = _case(rng, MAX_SEQS, 4)
    expected = _reference(buffers, accepted[:5].tolist(), next_token[:5].tolist(), 8, 4, 16)
    for advance in (verify_to_decode_inputs_torch, kernel.verify_to_decode_inputs_triton):
        got = {name: t.clone() for name, t in buffers.items()}
        advance(*(got[name] for name in NAMES), accepted, next_token, 5, 8, 4, 16)
        assert {name: t.tolist() for name, t in got.items()} == expected


def test_a_table_with_strided_rows_is_refused():
    buffers = _buffers(random.Random(2), 2, 4)
    accepted, next_token = _case(random.Random(3), 3, 2)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        kernel.verify_to_decode_inputs_triton(*(buffers[name] for name in NAMES[:5]), buffers["table"].t()[:3],
                                              accepted, next_token, 3, 4, 2, 4)


def test_the_dispatch_runs_the_twin_off_cuda():
    rng = random.Random(7)
    buffers = _buffers(rng, 3, 4)
    accepted, next_token = _case(rng, 3, 3)
    expected = _reference(buffers, accepted.tolist(), next_token.tolist(), 4, 3, 4)
    assert _run(verify_to_decode_inputs, buffers, accepted, next_token, 4, 3, 4, launches={}) == expected


@pytest.mark.skipif(not HAS_CUDA, reason="the direct launch calls a compiled kernel's launcher: CUDA only")
def test_direct_launches_advance_as_the_first():
    launches: dict = {}
    for i, (num_seqs, bucket, q) in enumerate([(4, 4, 5), (4, 4, 5), (1, 1, 2), (77, 80, 9), (150, 160, 17)]):
        rng = random.Random(100 + i)
        buffers = _buffers(rng, q, 16)
        accepted, next_token = _case(rng, num_seqs, q)
        expected = _reference(buffers, accepted.tolist(), next_token.tolist(), bucket, q, 16)
        assert _run(kernel.verify_to_decode_inputs_triton, buffers, accepted, next_token, bucket, q, 16,
                    launches=launches) == expected
    assert launches
