"""Logits controls on the device: presence, frequency and repetition penalties, logit bias, banned
tokens (bad words, min_tokens) and allowed tokens, applied in place to the rows of a step's
logits that ask for any of them.

What a row sees is described by LogitsControls (runner/logits_processing.py builds it from the
host's token lists): the tokens its output holds before it, counted per sequence and then per row
(a verify row also counts the drafts before it, so each row is processed as if those drafts had
been accepted), its prompt's tokens (for the repetition penalty), and the (row, token) pairs it
may not or only may produce. Everything is one tensor op over [rows, vocab]: no loop over the
vocabulary or the rows.

The order (vLLM's): bias added; then the repetition penalty on tokens seen in the prompt or the
output (a positive logit divided by it, a negative one multiplied); then frequency x count and
presence x seen-in-output subtracted; then banned tokens and tokens outside an allow list set to
-inf (an -inf logit stays -inf through every step before, so bans commute with them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsControls:
    """One step's controls. Rows are the processed logits rows, numbered 0..P-1 in `rows` order;
    sequences are the slots 0..S-1 the rows point into (all the rows of a verify share one)."""

    rows: torch.Tensor  # [P] int64: the logits row of each processed row
    row_sequence: torch.Tensor  # [P] int64: each processed row's sequence slot
    num_sequences: int  # S
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32 (1: off)
    output_sequence: torch.Tensor  # [N] int64: the slot of each token the outputs hold so far
    output_token_ids: torch.Tensor  # [N] int64
    draft_rows: torch.Tensor  # [D] int64: the processed row that counts this draft (one before it)
    draft_token_ids: torch.Tensor  # [D] int64
    prompt_sequence: torch.Tensor  # [M] int64: the slot of each prompt token (repetition only)
    prompt_token_ids: torch.Tensor  # [M] int64
    bias_sequence: torch.Tensor  # [B] int64
    bias_token_ids: torch.Tensor  # [B] int64
    bias_values: torch.Tensor  # [B] float32
    banned_rows: torch.Tensor  # [C] int64: processed row of each banned (row, token)
    banned_token_ids: torch.Tensor  # [C] int64
    allowed_sequence: torch.Tensor  # [A] int64: slot of each allowed (sequence, token)
    allowed_token_ids: torch.Tensor  # [A] int64
    restricted_sequences: torch.Tensor  # [S] bool: the sequence has an allow list
    counts_output: bool  # some row has a presence, frequency or repetition penalty
    any_repetition: bool
    any_bias: bool
    any_allowed: bool


def apply_logits_controls(logits: torch.Tensor, controls: LogitsControls) -> None:
    """logits [rows, vocab] float32, modified in place: the rows in controls.rows processed."""
    c = controls
    num_rows, vocab = c.rows.numel(), logits.shape[-1]
    if num_rows == 0:
        return
    device = logits.device
    sub = logits.index_select(0, c.rows)  # [P, vocab]
    if c.any_bias:
        bias = torch.zeros(c.num_sequences, vocab, dtype=torch.float32, device=device)  # [S, vocab]
        bias.index_put_((c.bias_sequence, c.bias_token_ids), c.bias_values, accumulate=True)
        sub += bias.index_select(0, c.row_sequence)
    if c.counts_output:
        counts = torch.zeros(c.num_sequences, vocab, dtype=torch.float32, device=device)  # [S, vocab]
        counts.index_put_((c.output_sequence, c.output_token_ids),
                          torch.ones_like(c.output_token_ids, dtype=torch.float32), accumulate=True)
        counts = counts.index_select(0, c.row_sequence)  # [P, vocab]
        counts.index_put_((c.draft_rows, c.draft_token_ids),
                          torch.ones_like(c.draft_token_ids, dtype=torch.float32), accumulate=True)
        in_output = counts > 0  # [P, vocab]
        if c.any_repetition:
            in_prompt = torch.zeros(c.num_sequences, vocab, dtype=torch.bool, device=device)  # [S, vocab]
            in_prompt[c.prompt_sequence, c.prompt_token_ids] = True
            seen = in_output | in_prompt.index_select(0, c.row_sequence)
            penalty = torch.where(seen, c.repetition[:, None], 1.0)  # [P, vocab]
            sub = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub -= c.frequency[:, None] * counts + c.presence[:, None] * in_output
    sub[c.banned_rows, c.banned_token_ids] = -torch.inf
    if c.any_allowed:
        allowed = torch.zeros(c.num_sequences, vocab, dtype=torch.bool, device=device)  # [S, vocab]
        allowed[c.allowed_sequence, c.allowed_token_ids] = True
        allowed |= ~c.restricted_sequences[:, None]
        sub.masked_fill_(~allowed.index_select(0, c.row_sequence), -torch.inf)
    logits.index_copy_(0, c.rows, sub)
