"""The CPU draft loop's catch-up inputs from host ints (spec_decode/catch_up_host.py) equal the
torch definition (ops/step/reference.catch_up_inputs_torch) value for value and dtype for dtype:
random batches with padding sequences, every accepted count, both token shifts, no chained steps,
rows and chained steps clamped at the last position, block sizes that split the rows."""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.step.reference import catch_up_inputs_torch
from foretell.spec_decode.catch_up_host import catch_up_inputs_host


def _inputs(rng: random.Random, num_seqs: int, q: int, block_size: int, last_position: int, live: int):
    width = (last_position + 1 + block_size - 1) // block_size + 1
    tokens = torch.tensor([[rng.randrange(1000) for _ in range(q)] for _ in range(num_seqs)], dtype=torch.int64)
    first_pos = torch.tensor([rng.randrange(0, last_position + 1) for _ in range(num_seqs)], dtype=torch.int64)
    accepted = torch.tensor([rng.randrange(q) for _ in range(num_seqs)], dtype=torch.int64)
    next_token = torch.tensor([rng.randrange(1000) for _ in range(num_seqs)], dtype=torch.int64)
    table = torch.tensor([[rng.randrange(500) for _ in range(width)] for _ in range(num_seqs)], dtype=torch.int32)
    return tokens, first_pos, accepted, next_token, torch.tensor(live, dtype=torch.int64), table


def _assert_same(host, reference):
    pairs = [(host.tokens, reference.tokens), (host.positions, reference.positions), (host.slots, reference.slots),
             (host.seq_lens, reference.seq_lens), (host.last_rows, reference.last_rows),
             (host.chained.positions, reference.chained.positions),
             (host.chained.seq_lens, reference.chained.seq_lens), (host.chained.slots, reference.chained.slots)]
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("seed", range(40))
def test_host_catch_up_inputs_equal_the_torch_definition(seed):
    rng = random.Random(seed)
    num_seqs, q = rng.randint(1, 5), rng.randint(1, 5)
    shift = rng.choice([0, 1])
    n = q + 1 - shift  # the draft loop's rows per sequence
    block_size = rng.choice([1, 2, 16])
    last_position = rng.randint(q + 2, 60)
    live = rng.randint(0, num_seqs)
    steps = rng.randint(0, 4)
    args = (*_inputs(rng, num_seqs, q, block_size, last_position, live), block_size, n, shift, steps, last_position)
    _assert_same(catch_up_inputs_host(*args), catch_up_inputs_torch(*args))


def test_rows_and_chained_steps_clamp_at_the_last_position():
    tokens = torch.tensor([[5, 6, 7, 8]])  # [1, q]
    args = (tokens, torch.tensor([18]), torch.tensor([3]), torch.tensor([9]), torch.tensor(1),
            torch.arange(4, dtype=torch.int32)[None, :], 8, 4, 1, 2, 20)
    host = catch_up_inputs_host(*args)
    assert host.positions.tolist() == [18, 19, 20, 20]
    assert host.chained.positions.tolist() == [[20], [20]]
    assert host.tokens.tolist() == [6, 7, 8, 9]
    _assert_same(host, catch_up_inputs_torch(*args))
