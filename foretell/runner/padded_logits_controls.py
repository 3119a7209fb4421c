"""The logits controls (penalties, logit_bias, min_tokens, bad words, allowed_token_ids) on the
padded device steps: the padded verify (graphed_verify.py) and plain decoding queued ahead
(decode_ahead.py, the q = 1 case), with the same results as the host step's
(logits_processing.py + ops/sampling/penalties.py), bit for bit in float32.

The host step rebuilds its controls every step from the host's token lists. A padded step cannot:
a step queued ahead is launched before the host has the tokens of the step before it. So the
controls of a step's sequences live on the device as per-sequence state of fixed shape, built from
the host's lists when a step is launched from host inputs (the batch may have changed: any
sequence may be new, gone, preempted or re-admitted, so nothing is carried over from an earlier
batch, which keeps the state exact by construction), and advanced on the device by each step's own
emitted tokens (its accepted drafts and next token) right after its verification, which is all a
step queued after it needs. The state of the c sequences that have controls (the others' rows are
left untouched):

  counts [c, vocab] float32      each token's occurrences in the output (presence, frequency,
                                 repetition); advanced by the emitted tokens
  in_prompt [c, vocab] bool      the prompt's tokens (repetition only); fixed
  bias [c, vocab] float32        logit_bias; fixed
  allowed [c, vocab] bool        allowed_token_ids (all True without a list); fixed
  num_output [c] int64           output tokens so far (min_tokens); advanced
  stop_ids [c, vocab] bool       what min_tokens bans: stop_token_ids and EOS; fixed
  history [c, H] int64           the last H tokens (H = the longest bad word - 1; -1 before the
                                 first token), what a bad word's prefix must end with; advanced

A verify row j of a sequence is processed as if the drafts before it had been accepted, as on
the host step: it counts drafts 0..j-1 as output tokens, as generated tokens for min_tokens and
as the last tokens for bad words. Everything is tensor ops over [c, q, vocab]: no host read, no
shape that depends on the data, so a step can be queued ahead of the host and captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.device_util import to_device
from foretell.engine.sequence import Sequence
from foretell.runner.logprobs import emitted_row_tokens
from foretell.sampling_params import SamplingParams


def padded_step_takes(params: SamplingParams) -> bool:
    """Whether a request's logits processing can run on the padded steps: everything but a
    grammar (structured outputs), whose matcher state lives on the host (foretell/structured/)."""
    return params.structured_outputs is None


def _counts_output(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _stop_ids(seq: Sequence) -> list[int]:
    """What min_tokens bans (the host step's list: logits_processing._ControlLists)."""
    p = seq.sampling_params
    return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(seq.eos_token_ids))


@dataclass
class PaddedLogitsControls:
    """The controls of one padded step's sequences, on the device (the module docstring says what
    each tensor holds and which ones advance). Built by for_sequences(); apply() processes a
    step's logits, advance() moves the state past the step's emitted tokens."""

    seq_index: torch.Tensor | None  # [c] int64: the step's sequences with controls (None: all n)
    num_controlled: int  # c
    presence: torch.Tensor  # [c] float32
    frequency: torch.Tensor  # [c] float32
    repetition: torch.Tensor  # [c] float32 (1: off)
    counts: torch.Tensor | None  # [c, vocab] float32 (None: no sequence has a penalty)
    in_prompt: torch.Tensor | None  # [c, vocab] bool (None: no repetition penalty)
    bias: torch.Tensor | None  # [c, vocab] float32
    allowed: torch.Tensor | None  # [c, vocab] bool
    min_tokens: torch.Tensor | None  # [c] int64 (None: no sequence has min_tokens)
    num_output: torch.Tensor | None  # [c] int64
    stop_ids: torch.Tensor | None  # [c, vocab] bool
    history: torch.Tensor | None  # [c, H] int64 (None: no bad words)
    word_sequence: torch.Tensor | None  # [W] int64: the controlled sequence of each bad word
    word_prefix: torch.Tensor | None  # [W, H] int64: its tokens but the last, right-aligned
    word_checks: torch.Tensor | None  # [W, H] bool: which of word_prefix's columns are the prefix's
    word_last: torch.Tensor | None  # [W] int64: the token it bans

    @classmethod
    def for_sequences(cls, seqs: list[Sequence], vocab_size: int,
                      device: torch.device) -> "PaddedLogitsControls | None":
        """The state of `seqs` (a step's sequences in order) as the host's token lists hold them
        now; None when none has controls. A grammar is no control here: its masks are the padded
        verify's (structured/padded_verify.py)."""
        index = [i for i, seq in enumerate(seqs) if seq.sampling_params.needs_logits_controls]
        if not index:
            return None
        controlled = [seqs[i] for i in index]
        params = [seq.sampling_params for seq in controlled]
        c = len(controlled)

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        def ids(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, device)

        def table(pairs: list[tuple[int, int]], dtype: torch.dtype, values: list[float] | None = None):
            """A [c, vocab] table holding ones (or `values`) at the (sequence, token) pairs."""
            out = torch.zeros(c, vocab_size, dtype=dtype, device=device)
            if pairs:
                rows, cols = ids([r for r, _ in pairs]), ids([t for _, t in pairs])
                add = torch.ones(len(pairs), dtype=dtype, device=device) if values is None else floats(values)
                out.index_put_((rows, cols), add, accumulate=dtype != torch.bool)
            return out

        counts = in_prompt = bias = allowed = min_tokens = num_output = stop_ids = None
        if any(_counts_output(p) for p in params):
            counts = table([(s, t) for s, seq in enumerate(controlled) if _counts_output(seq.sampling_params)
                            for t in seq.output_token_ids], torch.float32)
        if any(p.repetition_penalty != 1.0 for p in params):
            in_prompt = table([(s, t) for s, seq in enumerate(controlled) if seq.sampling_params.repetition_penalty
                               != 1.0 for t in seq.prompt_token_ids], torch.bool)
        if any(p.logit_bias for p in params):
            pairs = [(s, t, b) for s, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
            bias = table([(s, t) for s, t, _ in pairs], torch.float32, [b for _, _, b in pairs])
        if any(p.allowed_token_ids is not None for p in params):
            allowed = table([(s, t) for s, p in enumerate(params) for t in p.allowed_token_ids or []], torch.bool)
            allowed |= to_device([p.allowed_token_ids is None for p in params], torch.bool, device)[:, None]
        if any(p.min_tokens > 0 for p in params):
            min_tokens = ids([p.min_tokens for p in params])
            num_output = ids([seq.num_output_tokens for seq in controlled])
            stop_ids = table([(s, t) for s, seq in enumerate(controlled) for t in _stop_ids(seq)], torch.bool)
        words = cls._bad_words(controlled, device)
        return cls(
            seq_index=None if len(index) == len(seqs) else ids(index),
            num_controlled=c,
            presence=floats([p.presence_penalty for p in params]),
            frequency=floats([p.frequency_penalty for p in params]),
            repetition=floats([p.repetition_penalty for p in params]),
            counts=counts, in_prompt=in_prompt, bias=bias, allowed=allowed,
            min_tokens=min_tokens, num_output=num_output, stop_ids=stop_ids,
            **words,
        )

    @staticmethod
    def _bad_words(controlled: list[Sequence], device: torch.device) -> dict:
        """The bad words' tensors (all None without any): each word's prefix right-aligned in H
        columns, and each sequence's last H tokens (-1 where it has fewer: never a token)."""
        none = dict(history=None, word_sequence=None, word_prefix=None, word_checks=None, word_last=None)
        words = [(s, w) for s, seq in enumerate(controlled) for w in seq.sampling_params.bad_words_token_ids or []]
        if not words:
            return none
        width = max(1, max(len(w) for _, w in words) - 1)  # H (1 when every word is a single token)
        history = []
        for seq in controlled:
            last = seq.token_ids[max(0, len(seq.token_ids) - width):]
            history.append([-1] * (width - len(last)) + last)
        prefixes = [[-1] * (width - len(w) + 1) + w[:-1] for _, w in words]
        checks = [[False] * (width - len(w) + 1) + [True] * (len(w) - 1) for _, w in words]
        return dict(
            history=to_device(history, torch.int64, device),
            word_sequence=to_device([s for s, _ in words], torch.int64, device),
            word_prefix=to_device(prefixes, torch.int64, device),
            word_checks=to_device(checks, torch.bool, device),
            word_last=to_device([w[-1] for _, w in words], torch.int64, device),
        )

    def _select(self, values: torch.Tensor) -> torch.Tensor:
        """values [n, ...] -> the controlled sequences' [c, ...]."""
        return values if self.seq_index is None else values.index_select(0, self.seq_index)

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The processed logits of a step: logits [n, q, vocab] float32 (raw: left as they are),
        drafts [n, q - 1] int64 (the drafts the step verifies; row j counts drafts 0..j-1) ->
        [n, q, vocab] float32, a new tensor (the rows of sequences without controls copied)."""
        n, q, vocab = logits.shape
        sub = logits.clone() if self.seq_index is None else logits.index_select(0, self.seq_index)  # [c, q, vocab]
        c, device = self.num_controlled, logits.device
        drafts = self._select(drafts)  # [c, q - 1]
        # The order is the host's (ops/sampling/penalties.py): bias, repetition, frequency and
        # presence, bans, the allow list; the same float32 ops, so the same bits.
        if self.bias is not None:
            sub += self.bias[:, None, :]
        if self.counts is not None:
            counts = self.counts[:, None, :].repeat(1, q, 1)  # [c, q, vocab]
            if q > 1:  # row j also counts drafts 0..j-1: the pairs (j, t), t < j
                rows, earlier = torch.tril_indices(q, q, offset=-1, device=device)  # [P] each
                seq = torch.arange(c, device=device)[:, None].expand(c, rows.numel())
                counts.index_put_((seq, rows[None, :].expand_as(seq), drafts[:, earlier]),
                                  torch.ones(seq.shape, dtype=torch.float32, device=device), accumulate=True)
            in_output = counts > 0  # [c, q, vocab]
            if self.in_prompt is not None:
                seen = in_output | self.in_prompt[:, None, :]
                penalty = torch.where(seen, self.repetition[:, None, None], 1.0)  # [c, q, vocab]
                sub = torch.where(sub > 0, sub / penalty, sub * penalty)
            sub -= self.frequency[:, None, None] * counts + self.presence[:, None, None] * in_output
        if self.min_tokens is not None:  # row j is generated token num_output + j
            before = self.num_output[:, None] + torch.arange(q, device=device)[None, :]  # [c, q]
            sub.masked_fill_((before < self.min_tokens[:, None])[:, :, None] & self.stop_ids[:, None, :], -torch.inf)
        if self.history is not None:
            self._ban_bad_words(sub, drafts)
        if self.allowed is not None:
            sub.masked_fill_(~self.allowed[:, None, :], -torch.inf)
        if self.seq_index is None:
            return sub
        return logits.index_copy(0, self.seq_index, sub)

    def _ban_bad_words(self, sub: torch.Tensor, drafts: torch.Tensor) -> None:
        """-inf at (row j, a word's last token) where the H tokens before row j (the history, then
        drafts 0..j-1) end with the word's prefix; sub [c, q, vocab], in place."""
        c, q, vocab = sub.shape
        width = self.history.shape[1]
        context = torch.cat([self.history, drafts], dim=1)  # [c, H + q - 1]
        windows = context.unfold(1, width, 1)  # [c, q, H]: row j's last H tokens
        mine = windows.index_select(0, self.word_sequence)  # [W, q, H]
        same = (mine == self.word_prefix[:, None, :]) | ~self.word_checks[:, None, :]
        matched = same.all(dim=-1)  # [W, q]
        rows = torch.arange(q, device=sub.device)[None, :]
        flat = (self.word_sequence[:, None] * q + rows) * vocab + self.word_last[:, None]  # [W, q]
        # amin with +inf where a word does not match: duplicates (two words banning one token) in any order.
        ban = torch.where(matched, -torch.inf, torch.inf)
        sub.view(-1).scatter_reduce_(0, flat.reshape(-1), ban.reshape(-1), reduce="amin")

    def advance(self, drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor) -> None:
        """Move the state past a step's emitted tokens, on the device, in place: drafts [n, q - 1]
        int64 (what it verified), accepted [n] and next_token [n] int64 (what its verification
        decided; it emitted drafts 0..accepted-1 and the next token)."""
        q = drafts.shape[1] + 1
        accepted = self._select(accepted)  # [c]
        tokens = emitted_row_tokens(self._select(drafts), accepted, self._select(next_token))  # [c, q]
        emitted = torch.arange(q, device=tokens.device)[None, :] <= accepted[:, None]  # [c, q]
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens, emitted.to(torch.float32))
        if self.num_output is not None:
            self.num_output += accepted + 1
        if self.history is not None:
            width = self.history.shape[1]
            context = torch.cat([self.history, tokens], dim=1)  # [c, H + q]
            last = (accepted + 1)[:, None] + torch.arange(width, device=tokens.device)[None, :]  # [c, H]
            self.history.copy_(context.gather(1, last))
