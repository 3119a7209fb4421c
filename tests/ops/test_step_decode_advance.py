"""The decode advance (ops/step/decode_advance.py): a decode step's graph inputs turned into the
next one's. The Triton kernel (in Triton's interpreter on the CPU) and its torch twin are both held
to a plain-Python reference on random buffers: live sequences move one position on and feed the
given tokens, slots follow each table row, everything past the live sequences is left alone."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.step.decode_advance import advance_decode_inputs, advance_decode_inputs_torch

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernel = import_interpreted("foretell.ops.step.triton_decode_advance")
MAX_SEQS, MAX_BLOCKS = 160, 6


def _buffers(rng: random.Random, block_size: int) -> dict:
    """Random decode buffers of MAX_SEQS sequences whose next position fits their table."""
    positions = [rng.randrange(0, MAX_BLOCKS * block_size - 1) for _ in range(MAX_SEQS)]
    table = [[rng.randrange(1000) for _ in range(MAX_BLOCKS)] for _ in range(MAX_SEQS)]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return dict(
        input_ids=tensor([rng.randrange(50_000) for _ in range(MAX_SEQS)], torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor([rng.randrange(-1, 5000) for _ in range(MAX_SEQS)], torch.int64),
        seq_lens=tensor([rng.randrange(1, 100) for _ in range(MAX_SEQS)], torch.int32),
        table=tensor(table, torch.int32),
    )


def _reference(buffers: dict, tokens: list[int], block_size: int) -> dict:
    """What the advance leaves, one sequence at a time in Python."""
    out = {name: t.tolist() for name, t in buffers.items()}
    for b, token in enumerate(tokens):
        pos = out["positions"][b] + 1
        out["positions"][b] = pos
        out["input_ids"][b] = token
        out["seq_lens"][b] = pos + 1
        out["slot_mapping"][b] = out["table"][b][pos // block_size] * block_size + pos % block_size
    return out


def _run(advance, buffers: dict, tokens: torch.Tensor, block_size: int, **kwargs) -> dict:
    got = {name: t.clone() for name, t in buffers.items()}
    n = tokens.shape[0]
    advance(got["input_ids"], got["positions"], got["slot_mapping"], got["seq_lens"], got["table"][:n], tokens,
            block_size, **kwargs)
    return {name: t.tolist() for name, t in got.items()}


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 129, MAX_SEQS])  # 129: two programs, the second one masked
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_kernel_and_twin_equal_the_reference(num_seqs, block_size):
    rng = random.Random(num_seqs * 31 + block_size)
    buffers = _buffers(rng, block_size)
    tokens = torch.tensor([rng.randrange(50_000) for _ in range(num_seqs)], dtype=torch.int64, device=DEVICE)
    expected = _reference(buffers, tokens.tolist(), block_size)
    assert _run(advance_decode_inputs_torch, buffers, tokens, block_size) == expected
    assert _run(kernel.advance_decode_inputs_triton, buffers, tokens, block_size) == expected


def test_tokens_may_be_a_view_of_a_longer_output():
    """The tokens are the graph's argmax output sliced to the live rows (a view of a longer tensor)."""
    rng = random.Random(5)
    buffers = _buffers(rng, 4)
    greedy = torch.arange(100, 100 + MAX_SEQS, dtype=torch.int64, device=DEVICE)
    expected = _reference(buffers, list(range(100, 105)), 4)
    assert _run(kernel.advance_decode_inputs_triton, buffers, greedy[:5], 4) == expected
    assert _run(advance_decode_inputs_torch, buffers, greedy[:5], 4) == expected


def test_no_sequences_changes_nothing():
    buffers = _buffers(random.Random(1), 4)
    before = {name: t.tolist() for name, t in buffers.items()}
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert _run(kernel.advance_decode_inputs_triton, buffers, empty, 4) == before
    assert _run(advance_decode_inputs_torch, buffers, empty, 4) == before


def test_a_table_with_strided_rows_is_refused():
    buffers = _buffers(random.Random(2), 4)
    tokens = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        kernel.advance_decode_inputs_triton(buffers["input_ids"], buffers["positions"], buffers["slot_mapping"],
                                            buffers["seq_lens"], buffers["table"].t()[:3], tokens, 4)


def test_the_dispatch_runs_the_twin_off_cuda():
    rng = random.Random(7)
    buffers = _buffers(rng, 4)
    tokens = torch.tensor([9, 8, 7], dtype=torch.int64, device=DEVICE)
    expected = _reference(buffers, [9, 8, 7], 4)
    assert _run(advance_decode_inputs, buffers, tokens, 4, launches={}) == expected


@pytest.mark.skipif(not HAS_CUDA, reason="the direct launch calls a compiled kernel's launcher: CUDA only")
def test_direct_launches_advance_as_the_first():
    """With a launches dict the first launch keeps the compiled kernel and later ones call its
    launcher directly; every launch (other sizes, other token views) advances as the reference."""
    launches: dict = {}
    for i, num_seqs in enumerate([4, 4, 1, 77, 160, 4]):
        rng = random.Random(100 + i)
        buffers = _buffers(rng, 16)
        greedy = torch.tensor([rng.randrange(50_000) for _ in range(MAX_SEQS)], dtype=torch.int64, device=DEVICE)
        expected = _reference(buffers, greedy[:num_seqs].tolist(), 16)
        assert _run(kernel.advance_decode_inputs_triton, buffers, greedy[:num_seqs], 16, launches=launches) == expected
    assert launches
