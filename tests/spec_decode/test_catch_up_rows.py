"""The host step's catch-up rows (spec_decode/draft_loop.catch_up_rows): which token each row is
fed, its position, its KV slot and its attention metadata, against a per-row Python reference,
and against the padded step's catch-up (ops/step reference.catch_up_inputs_torch), whose
definition it shares."""

from __future__ import annotations

import random

import pytest
import torch

from foretell.ops.step import reference
from foretell.spec_decode.draft_loop import catch_up_rows
from foretell.spec_decode.proposer import DraftBatch

BLOCK = 4
MAX_MODEL_LEN = 40


def _batch(starts, valid, samples, seed=0) -> DraftBatch:
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(starts)
    width = max((p + v) // BLOCK + 1 for p, v in zip(starts, valid))  # through each next token's block
    table = torch.randperm(num_seqs * width + 7, generator=gen)[: num_seqs * width].to(torch.int32)
    tokens = torch.randint(0, 1000, (sum(valid),), generator=gen)
    next_ids = torch.randint(1000, 2000, (num_seqs,), generator=gen).tolist()
    return DraftBatch(
        start_positions=list(starts), num_valid_rows=list(valid), next_token_ids=next_ids, samples=list(samples),
        token_ids=tokens, hidden_states=torch.zeros(sum(valid), 2), aux_hidden_states=[],
        block_table=table.view(num_seqs, width), block_size=BLOCK, sampling_params=[None] * num_seqs,
        sample_indices=[0] * num_seqs, max_model_len=MAX_MODEL_LEN,
    )


def _expected(batch: DraftBatch, row_offset: int):
    """Per row, in Python: a sequence's rows start at p0; row r is fed the token at p0 + r - row_offset
    of its valid rows then its next token; EAGLE3/MTP keep v rows, a draft LM v + 1 when it samples."""
    tokens, positions, slots, counts = [], [], [], []
    flat = batch.token_ids.tolist()
    start = 0
    for i, (p0, v) in enumerate(zip(batch.start_positions, batch.num_valid_rows)):
        stream = flat[start : start + v] + [batch.next_token_ids[i]]
        start += v
        count = v + 1 if row_offset == 0 and batch.samples[i] else v
        for r in range(count):
            position = p0 + r
            tokens.append(stream[r - row_offset])
            positions.append(position)
            slots.append(int(batch.block_table[i, position // BLOCK]) * BLOCK + position % BLOCK)
        counts.append(count)
    return tokens, positions, slots, counts


CASES = {
    "one decode": ([12], [3], [True]),
    "equal decodes": ([0, 9, 20], [4, 4, 4], [True, True, True]),
    "mixed accepts": ([5, 17, 30, 2], [1, 4, 2, 3], [True, True, True, True]),
    "prefill chunk and decodes": ([0, 8, 21], [11, 2, 1], [False, True, True]),
    "near the limit": ([35, 30], [4, 8], [True, False]),  # 35 + 4 = 39: the next token at the last position
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("row_offset", [-1, 0])
@pytest.mark.parametrize("draft_block_size", [BLOCK, 2])
def test_catch_up_rows_match_per_row_reference(case, row_offset, draft_block_size):
    starts, valid, samples = CASES[case]
    if row_offset == 0:  # a draft LM samples only where its next token sits below the limit
        samples = [s and p + v + 1 < MAX_MODEL_LEN for s, p, v in zip(samples, starts, valid)]
    batch = _batch(starts, valid, samples)
    input_ids, positions, metadata = catch_up_rows(batch, row_offset, draft_block_size)
    tokens, want_positions, slots, counts = _expected(batch, row_offset)
    assert input_ids.tolist() == tokens
    assert positions.tolist() == want_positions and positions.dtype == torch.int64
    assert metadata.slot_mapping.tolist() == slots and metadata.slot_mapping.dtype == torch.int64
    query_start = [0]
    for c in counts:
        query_start.append(query_start[-1] + c)
    assert metadata.query_start_loc_cpu == query_start
    assert metadata.query_start_loc.tolist() == query_start
    assert metadata.seq_lens_cpu == [p + c for p, c in zip(starts, counts)]
    assert metadata.seq_lens.tolist() == metadata.seq_lens_cpu
    assert metadata.seq_lens.data_ptr() % 16 == 0  # one upload with the query starts, still aligned for Triton
    assert metadata.max_query_len == max(counts)
    assert metadata.block_size == draft_block_size


@pytest.mark.parametrize("row_offset", [-1, 0])
def test_host_catch_up_is_the_padded_catch_up_through_the_drafting_row(row_offset):
    """A verify of q rows that accepted a drafts, seen by the host step (v = a + 1 valid rows, next
    token x), feeds the same tokens at the same positions and slots as the padded step's catch-up
    rows 0 .. a + 1 - shift (the row that drafts token 1)."""
    rng = random.Random(3)
    q, shift = 4, -row_offset
    accepted = [0, 3, 1, 2]
    starts = [rng.randint(0, MAX_MODEL_LEN - q - 2) for _ in accepted]
    verify = torch.randint(0, 1000, (len(accepted), q), generator=torch.Generator().manual_seed(1))
    host = _batch(starts, [a + 1 for a in accepted], [True] * len(accepted))
    host.token_ids = torch.cat([verify[i, : a + 1] for i, a in enumerate(accepted)])
    input_ids, positions, metadata = catch_up_rows(host, row_offset, BLOCK)

    n = q + 1 - shift
    padded = reference.catch_up_inputs_torch(
        verify, torch.tensor(starts), torch.tensor(accepted), torch.tensor(host.next_token_ids),
        torch.tensor(len(accepted)), host.block_table, BLOCK, n, shift, 0, MAX_MODEL_LEN - 1,
    )
    drafting = padded.last_rows.tolist()
    kept = [i * n + r for i in range(len(accepted)) for r in range(drafting[i] - i * n + 1)]
    assert input_ids.tolist() == padded.tokens[kept].tolist()
    assert positions.tolist() == padded.positions[kept].tolist()
    assert metadata.slot_mapping.tolist() == padded.slots[kept].tolist()
    ends = [metadata.query_start_loc_cpu[i + 1] - 1 for i in range(len(accepted))]
    assert [kept[e] for e in ends] == drafting  # the host's last row of each sequence drafts token 1
