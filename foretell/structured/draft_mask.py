"""DraftMask: the grammar masks of a model drafter's loop (EAGLE3, MTP, a draft LM), so that its
drafts follow the grammar the target is held to and acceptance does not collapse under it.

HostStep.propose() makes one per engine step when a sequence that drafts has structured outputs
(StructuredOutputs.draft_mask; None otherwise, and the loop then does nothing more than before).
It holds each such sequence's matcher, advanced through the tokens this step emits. The draft
loop (spec_decode/draft_loop.py) calls begin() with the rows it drafts for and gets a DraftGrammar:

  mask(logits)    before each draft position's argmax or draw: -inf on the drafter's logits where
                  the grammar forbids the token, row by row, in the drafter's own vocabulary (an
                  EAGLE3 head's d2t maps its ids to the target's; the target-id mask is read
                  through it); all rows' masks are computed in one llguidance call;
  force(tokens, q) where the grammar forces the next token (llguidance's fast-forward tokens: the
                  text only one continuation has, tokenized as the tokenizer would), that token is
                  the row's draft, whatever the drafter chose, and its q is one-hot there (it was
                  certain): an EAGLE3 head cannot propose a token outside its vocabulary, and a
                  forced token is the one the target almost always takes;
  advance(tokens) the drafted tokens (target ids) consumed by each row's own copy of its matcher
                  (llguidance's deep_copy: a few microseconds), so the next position's mask is
                  the grammar's state after the drafts so far.

The sequences' matchers themselves never move: the copies are dropped with the loop. A row stops
being masked once its grammar has ended (an EOS was drafted), cannot take the draft (a row whose
allowed tokens are all outside an EAGLE3 head's vocabulary keeps its unmasked logits there), or
allows nothing: its later drafts are whatever the drafter proposes, which the target's verify
judges as always (and StructuredOutputs.grammar_drafts cuts where that is exact).

Exactness: a sampled draft is drawn from the masked logits, and the loop keeps the distribution
it was drawn from (softmax of the masked, processed logits) as q for rejection sampling, so the
verify stays exact; greedy drafts are the masked argmax. Only acceptance changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from foretell.device_util import to_device
from foretell.structured.bitmask import BitmaskBuffer, TokenBitsCache
from foretell.structured.matcher import SequenceMatcher


@dataclass
class MaskTimer:
    """Host seconds spent on grammar masks on the engine's thread (StructuredOutputs keeps one;
    measurements read it): seconds is all of it, the others its parts."""

    seconds: float = 0.0
    verify_fill_seconds: float = 0.0  # a verify's rows: filled here, or waited for from the worker
    verify_apply_seconds: float = 0.0  # their copy to the device and the masking op
    draft_seconds: float = 0.0  # the drafter loop's masks (DraftGrammar)
    fill_ahead_seconds: float = 0.0  # handing the next step's rows to the worker thread (fill_ahead)
    rows_filled_ahead: int = 0  # verify rows the worker thread had ready (StructuredOutputs.fill_ahead)
    forced_seconds: float = 0.0  # the proposer's drafts shaped by the grammar (StructuredOutputs.grammar_drafts)
    forced_drafts: int = 0  # drafts that are the grammar's forced tokens, appended or replacing the proposer's
    replaced_drafts: int = 0  # proposer drafts replaced by forced tokens
    held_back_drafts: int = 0  # forced drafts that are the token a fast-forward run held back (forced_drafts.py)

    def add_draft(self, seconds: float) -> None:
        self.draft_seconds += seconds
        self.seconds += seconds


class DraftMask:
    def __init__(
        self,
        matchers: list[SequenceMatcher | None],  # per sequence of the DraftBatch: its grammar, or None
        executor,  # llguidance.LLExecutor
        buffer: BitmaskBuffer,
        timer: MaskTimer,
        token_bits: TokenBitsCache | None = None,  # the drafter's vocabulary in mask words (the runtime's, kept)
    ):
        self.matchers = matchers
        self.executor = executor
        self.buffer = buffer
        self.timer = timer
        self.token_bits = token_bits or TokenBitsCache()

    def begin(self, seq_indices: list[int], target_id_map: torch.Tensor | None) -> "DraftGrammar | None":
        """The masks of a loop drafting for these sequences (row j = sequence seq_indices[j]);
        target_id_map [draft_vocab] int64: the target id of each draft id (None: the same ids).
        None when none of them has a grammar."""
        rows = {j: self.matchers[i] for j, i in enumerate(seq_indices) if self.matchers[i] is not None}
        if not rows:
            return None
        return DraftGrammar(len(seq_indices), rows, self.executor, self.buffer, target_id_map, self.timer,
                            self.token_bits)


class DraftGrammar:
    def __init__(self, num_rows: int, rows: dict[int, SequenceMatcher], executor, buffer: BitmaskBuffer,
                 target_id_map: torch.Tensor | None, timer: MaskTimer, token_bits: TokenBitsCache | None = None):
        self.timer = timer
        self.token_bits = token_bits or TokenBitsCache()
        self.num_rows = num_rows
        self.sequences = rows  # row -> its sequence's matcher (EOS ids, end tokens)
        self.copies = {j: m.matcher.deep_copy() for j, m in rows.items()}  # row -> llguidance.LLMatcher
        self.executor = executor
        self.buffer = buffer
        self.target_id_map = target_id_map
        self.host_rows: np.ndarray | None = None  # [num_rows, words] int32: the last mask()'s rows
        self.forced: dict[int, int] = {}  # row -> the token its grammar forces next (from mask())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_rows, draft_vocab] -> the same with -inf where each live row's grammar
        forbids the token (a new tensor; rows without a live grammar are unchanged)."""
        started = time.perf_counter()
        host = self.buffer.rows(self.num_rows)  # [num_rows, words]
        host.fill(-1)  # every token allowed: rows without a live grammar
        if self.copies:
            self.executor.unsafe_compute_mask_ptr(list((m, j) for j, m in self.copies.items()),
                                                  host.ctypes.data, host.shape[1] * 4, self.num_rows)
        self.forced = {}
        vocabulary = self.token_bits.get(self.target_id_map, logits.shape[1], host.shape[1], logits.device)
        unmasked = []  # live rows that allow none of the drafter's tokens
        for j in list(self.copies):
            copy = self.copies[j]
            if copy.is_error() or not self.sequences[j].set_end_tokens(host[j], copy.is_accepting()):
                self._drop(j, host)
                continue
            fast_forward = copy.compute_ff_tokens()
            if fast_forward and SequenceMatcher.allows(host[j], fast_forward[0]):
                self.forced[j] = fast_forward[0]
            if not vocabulary.allows_any(host[j]):
                unmasked.append(j)
        self.host_rows = host
        if not self.copies:
            self.timer.add_draft(time.perf_counter() - started)
            return logits
        bits = self.buffer.to_device(self.num_rows)  # [num_rows, words]
        forbid = vocabulary.forbidden(bits)  # [num_rows, draft_vocab] bool
        # A row that allows none of the drafter's tokens (an EAGLE3 head's smaller vocabulary)
        # keeps its logits: its draft is the forced token, or is not taken (advance() drops it).
        for j in unmasked:
            forbid[j] = False
        masked = logits.masked_fill(forbid, float("-inf"))
        self.timer.add_draft(time.perf_counter() - started)
        return masked

    def force(self, tokens: torch.Tensor, probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [num_rows] int64 target ids, probs [num_rows, target_vocab] or None: the rows
        whose grammar forces a token get it, with one-hot probabilities (new tensors)."""
        if not self.forced:
            return tokens, probs
        # One upload: the rows and their forced tokens.
        rows, forced = to_device([list(self.forced), list(self.forced.values())], torch.int64, tokens.device)  # [f] each
        tokens = tokens.index_put((rows,), forced)
        if probs is not None:
            probs = probs.index_put((rows,), probs.new_zeros(())).index_put((rows, forced), probs.new_ones(()))
        return tokens, probs

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [num_rows] int64 target ids: the drafts mask()'s logits gave; each live row's
        grammar takes its draft, or stops there (an EOS, a token it forbids)."""
        if not self.copies:
            return
        drafted = tokens.tolist()
        started = time.perf_counter()
        for j in list(self.copies):
            token = drafted[j]
            sequence = self.sequences[j]
            if (token in sequence.eos_token_ids or token >= self.host_rows.shape[1] * 32
                    or not SequenceMatcher.allows(self.host_rows[j], token)
                    or not self.copies[j].consume_token(token)):
                self._drop(j, None)
        self.timer.add_draft(time.perf_counter() - started)

    def _drop(self, row: int, host: np.ndarray | None) -> None:
        del self.copies[row]
        if host is not None:
            host[row] = -1
