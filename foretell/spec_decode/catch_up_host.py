"""The padded draft loop's catch-up inputs computed from host ints, for a loop that runs on the CPU.

On the CPU the "device" tensors the verifier writes (accepted counts, next tokens) are host memory:
reading them costs a copy of a few ints, not a synchronisation. catch_up_inputs_host reads them
once and computes what ops/step's catch_up_inputs does with some forty small torch ops (each one's
dispatch costs more than its arithmetic at these sizes, and more again after a weight read has
emptied the caches) in Python ints, returning the same CatchUpInputs, value for value, as two
tensors' views (one int64, one int32). The definition it follows is catch_up_rows_torch's
(ops/step/reference.py); tests/spec_decode/test_catch_up_host.py holds the two equal.
"""

from __future__ import annotations

import torch

from foretell.ops.step.inputs import CatchUpInputs, ChainStepInputs


def catch_up_inputs_host(
    tokens: torch.Tensor,  # [B, q] int64 (CPU): the verify step's input tokens
    first_pos: torch.Tensor,  # [B] int64: the verify step's first position p0
    accepted: torch.Tensor,  # [B] int64
    next_token: torch.Tensor,  # [B] int64
    num_live: torch.Tensor,  # 0-d int64: sequences below it are live, the rest padding (slot -1)
    table: torch.Tensor,  # [B, W] int32, the target's blocks
    block_size: int,
    rows_per_seq: int,  # n
    shift: int,  # 1 when row r reads the token at p0 + r + 1 (EAGLE3, MTP), 0 for a draft LM
    chained_steps: int,  # S: the single-row steps after the catch-up
    last_position: int,  # max_model_len - 1: no row is placed past it
) -> CatchUpInputs:
    """ops/step/dispatch.catch_up_inputs for CPU tensors, from host ints (the module docstring)."""
    num_seqs, q = tokens.shape
    n, steps = rows_per_seq, chained_steps
    live = int(num_live)
    token_rows, starts, counts, nexts = tokens.tolist(), first_pos.tolist(), accepted.tolist(), next_token.tolist()
    table_rows = table.tolist()

    def slot(b: int, position: int) -> int:
        return table_rows[b][position // block_size] * block_size + position % block_size if b < live else -1

    fed, positions, slots, last_rows, seq_lens = [], [], [], [], []
    chained_positions = [[0] * num_seqs for _ in range(steps)]  # [S][B]
    chained_slots = [[0] * num_seqs for _ in range(steps)]
    for b in range(num_seqs):
        # the tokens at p0 .. p0 + q: [t, d_1 .. d_a, x], x also past them
        at_position = [token if offset <= counts[b] else nexts[b]
                       for offset, token in enumerate(token_rows[b] + [nexts[b]])]
        for r in range(n):
            position = min(starts[b] + r, last_position)
            fed.append(at_position[shift + r])
            positions.append(position)
            slots.append(slot(b, position))
        next_row = counts[b] + 1 - shift
        last_rows.append(b * n + next_row)
        seq_lens.append(min(starts[b] + n, last_position + 1))
        for j in range(1, steps + 1):
            position = min(starts[b] + next_row + j, last_position)
            chained_positions[j - 1][b] = position
            chained_slots[j - 1][b] = slot(b, position)
    rows = num_seqs * n
    flat_chained = [p for step in chained_positions for p in step]
    int64 = torch.tensor(fed + positions + slots + last_rows + flat_chained
                         + [s for step in chained_slots for s in step], dtype=torch.int64, device=tokens.device)
    int32 = torch.tensor(seq_lens + [p + 1 for p in flat_chained], dtype=torch.int32, device=tokens.device)
    chained_at = 3 * rows + num_seqs  # where the chained positions start in int64
    chained_count = steps * num_seqs
    return CatchUpInputs(
        tokens=int64[:rows],
        positions=int64[rows : 2 * rows],
        slots=int64[2 * rows : 3 * rows],
        seq_lens=int32[:num_seqs],
        last_rows=int64[3 * rows : chained_at],
        chained=ChainStepInputs(
            int64[chained_at : chained_at + chained_count].view(steps, num_seqs),
            int32[num_seqs:].view(steps, num_seqs),
            int64[chained_at + chained_count :].view(steps, num_seqs),
        ),
    )
