"""A padded verify step's bookkeeping (ops/step/): each Triton kernel (in Triton's
interpreter on the CPU) against its torch twin on random batches, and the twins against the
definitions they implement (written out here row by row)."""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.triton_interpreter import HAS_CUDA, import_interpreted, interpreter_mode  # noqa: F401
from foretell.ops.step import reference
from foretell.spec_decode.simulated_acceptance import ROW_STRIDE, SimulatedAcceptance

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
kernels = import_interpreted("foretell.ops.step.triton_kernels")
WIDTH = 12  # blocks per sequence in the tables


def _table(rng: random.Random, num_seqs: int) -> torch.Tensor:
    blocks = rng.sample(range(500), num_seqs * WIDTH)
    return torch.tensor(blocks, dtype=torch.int32, device=DEVICE).view(num_seqs, WIDTH)


def _slot(table, seq, pos, block_size):
    return int(table[seq, pos // block_size]) * block_size + pos % block_size


def _verify_step(rng: random.Random, num_seqs: int, q: int):
    """greedy [B, q], drafts [B, k] agreeing with it for a random prefix."""
    greedy = torch.tensor([[rng.randrange(1000) for _ in range(q)] for _ in range(num_seqs)], device=DEVICE)
    drafts = greedy[:, : q - 1].clone()
    for b in range(num_seqs):
        miss = rng.randrange(q)  # q - 1: every draft agrees
        if miss < q - 1:
            drafts[b, miss] += 1
    return greedy, drafts


@pytest.mark.parametrize("num_seqs,q,capped", [(1, 4, False), (5, 4, True), (70, 3, False), (8, 2, True)])
def test_accept_matches_twin_and_definition(interpreter_mode, num_seqs, q, capped):
    rng = random.Random(num_seqs * 10 + q)
    greedy, drafts = _verify_step(rng, num_seqs, q)
    caps = torch.tensor([rng.randrange(q) for _ in range(num_seqs)], device=DEVICE) if capped else None
    outs = []
    for accept in (reference.accept_drafts_torch, kernels.accept_drafts_triton):
        accepted, next_token = torch.full((80,), -7, device=DEVICE), torch.full((80,), -7, device=DEVICE)
        num_live = torch.zeros((), dtype=torch.int64, device=DEVICE)
        accept(greedy, drafts, caps, accepted, next_token, num_live)
        outs.append((accepted.tolist(), next_token.tolist(), int(num_live)))
    assert outs[0] == outs[1]
    accepted, next_token, num_live = outs[0]
    assert num_live == num_seqs and accepted[num_seqs:] == [-7] * (80 - num_seqs)  # nothing past B written
    for b in range(num_seqs):
        agree = 0
        while agree < q - 1 and drafts[b, agree] == greedy[b, agree]:
            agree += 1
        expected = min(agree, int(caps[b])) if capped else agree
        assert accepted[b] == expected and next_token[b] == greedy[b, expected]


@pytest.mark.parametrize("num_seqs,capped", [(1, False), (16, True), (67, False)])
def test_simulated_accept_draws_the_twins_counts(interpreter_mode, num_seqs, capped):
    rng = random.Random(num_seqs)
    greedy, drafts = _verify_step(rng, num_seqs, 4)
    caps = torch.tensor([rng.randrange(4) for _ in range(num_seqs)], device=DEVICE) if capped else None
    draws = SimulatedAcceptance([0.9, 0.6, 0.3], seed=num_seqs)
    outs = []
    for accept in (reference.accept_drawn_torch, kernels.accept_drawn_triton):
        draws.num_steps = 5
        accepted, next_token = torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE), torch.zeros_like(greedy[:, 0])
        num_live = torch.zeros((), dtype=torch.int64, device=DEVICE)
        start, rates = draws.device_step(DEVICE)
        accept(greedy, start, rates, ROW_STRIDE, caps, accepted, next_token, num_live)
        outs.append((accepted.tolist(), next_token.tolist(), int(num_live)))
    assert outs[0] == outs[1]
    draws.num_steps = 5
    drawn = draws.accepted_counts(num_seqs, DEVICE).tolist()
    accepted, next_token, num_live = outs[0]
    assert num_live == num_seqs
    for b in range(num_seqs):
        expected = min(drawn[b], int(caps[b])) if capped else drawn[b]
        assert accepted[b] == expected and next_token[b] == greedy[b, expected]


@pytest.mark.parametrize("num_seqs,num_live,q,shift,block_size", [(1, 1, 4, 1, 16), (4, 3, 4, 1, 4), (3, 3, 3, 0, 8),
                                                                   (9, 5, 2, 0, 4)])
@pytest.mark.parametrize("near_limit", [False, True])
def test_catch_up_and_chain_steps_match_twin_and_definition(interpreter_mode, num_seqs, num_live, q, shift,
                                                            block_size, near_limit):
    rng = random.Random(num_seqs + q + shift)
    n = q + 1 - shift  # rows per sequence, as the draft loop feeds them
    tokens = torch.tensor([[rng.randrange(1000) for _ in range(q)] for _ in range(num_seqs)], device=DEVICE)
    first_pos = torch.tensor([rng.randrange(0, WIDTH * block_size - 3 * q) for _ in range(num_seqs)], device=DEVICE)
    accepted = torch.tensor([rng.randrange(q) for _ in range(num_seqs)], device=DEVICE)
    next_token = torch.tensor([rng.randrange(1000) for _ in range(num_seqs)], device=DEVICE)
    live = torch.tensor(num_live, device=DEVICE)
    table = _table(rng, num_seqs)
    steps = q - 1  # chained single-row steps after the catch-up
    # Near max_model_len: the limit sits right after the first sequence's catch-up rows, so its
    # chained steps (and other sequences' rows) are placed at last_position.
    last = int(first_pos[0]) + n - 1 if near_limit else WIDTH * block_size - 1
    args = (tokens, first_pos, accepted, next_token, live, table, block_size, n, shift, steps, last)
    twin, kernel = reference.catch_up_inputs_torch(*args), kernels.catch_up_inputs_triton(*args)
    for field in ("tokens", "positions", "slots", "seq_lens", "last_rows"):
        assert torch.equal(getattr(twin, field), getattr(kernel, field)), field
    for field in ("positions", "seq_lens", "slots"):
        assert torch.equal(getattr(twin.chained, field), getattr(kernel.chained, field)), field
        assert getattr(twin.chained, field).shape == (steps, num_seqs)
    for b in range(num_seqs):
        p0, a, x = int(first_pos[b]), int(accepted[b]), int(next_token[b])
        at_position = tokens[b].tolist()[: a + 1] + [x] * (q + 1)  # t, d_1 .. d_a, then x
        for r in range(n):
            row, pos = b * n + r, min(p0 + r, last)
            assert twin.tokens[row] == at_position[r + shift] and twin.positions[row] == pos
            assert twin.slots[row] == (_slot(table, b, pos, block_size) if b < num_live else -1)
        assert twin.seq_lens[b] == min(p0 + n, last + 1) and twin.last_rows[b] == b * n + a + 1 - shift
        for j in range(1, steps + 1):
            step = twin.chain_step(j)
            pos = min(p0 + a + 1 - shift + j, last)
            assert step.positions[b] == pos and step.seq_lens[b] == pos + 1
            assert step.slots[b] == (_slot(table, b, pos, block_size) if b < num_live else -1)


@pytest.mark.parametrize("num_seqs,q,block_size", [(1, 4, 16), (6, 4, 4), (3, 2, 8)])
def test_advance_verify_matches_twin_and_definition(interpreter_mode, num_seqs, q, block_size):
    rng = random.Random(num_seqs * q)
    rows = num_seqs * q
    first = [rng.randrange(0, WIDTH * block_size - 3 * q) for _ in range(num_seqs)]
    positions = torch.tensor([p + r for p in first for r in range(q)] + [-1] * 4, device=DEVICE)
    accepted = torch.tensor([rng.randrange(q) for _ in range(num_seqs)], device=DEVICE)
    next_token = torch.tensor([rng.randrange(1000) for _ in range(num_seqs)], device=DEVICE)
    drafts = torch.tensor([[rng.randrange(1000) for _ in range(q - 1)] for _ in range(num_seqs)], device=DEVICE)
    drafts = drafts.t().contiguous().t()  # [B, q - 1] as the draft loop returns it: one row per step
    table = _table(rng, num_seqs)
    buffers = []
    for advance in (reference.advance_verify_inputs_torch, kernels.advance_verify_inputs_triton):
        out = (torch.full((rows + 4,), -3, device=DEVICE), positions.clone(), torch.full((rows + 4,), -3, device=DEVICE),
               torch.full((num_seqs + 2,), -3, dtype=torch.int32, device=DEVICE))
        advance(out[0], out[1], out[2], out[3], table, accepted, next_token, drafts, block_size)
        buffers.append(out)
    for twin, kernel in zip(*buffers):
        assert torch.equal(twin, kernel)
    input_ids, new_positions, slots, seq_lens = buffers[0]
    for b in range(num_seqs):
        start = first[b] + int(accepted[b]) + 1
        assert input_ids[b * q : (b + 1) * q].tolist() == [int(next_token[b])] + drafts[b].tolist()
        assert new_positions[b * q : (b + 1) * q].tolist() == list(range(start, start + q))
        assert slots[b * q : (b + 1) * q].tolist() == [_slot(table, b, p, block_size) for p in range(start, start + q)]
        assert seq_lens[b] == start + q
    assert new_positions[rows:].tolist() == [-1] * 4 and seq_lens[num_seqs:].tolist() == [-3, -3]  # untouched
