"""StructuredOutputs: the runner's side of structured outputs (runner/host_step.py holds one).

Per sequence with SamplingParams.structured_outputs it keeps a SequenceMatcher (matcher.py),
created at the sequence's first sampling step and brought up to its output tokens at every step
(after a preemption, forget() drops it and the next step replays the output into a new one).

mask_logits(): before the sampler or the verifier, every sampling row of such a sequence gets its
grammar's mask as -inf on the logits, row j of a verify as if drafts d_0..d_{j-1} had been
accepted: every row of the step filled by one llguidance call (batched_fill.py) into a reusable
host buffer (pinned on CUDA), one host-to-device copy, applied on the device (bitmask.py).
Greedy verification then accepts a draft only where the masked target picks it, and rejection
sampling runs against the masked distribution, so the output is exactly what plain masked
decoding gives, under every drafter.

fill_ahead(): at the end of a step (HostStep, after the drafts are known) the next step's rows
are walked by llguidance on a worker thread while the engine finishes this step, schedules and
launches the next; mask_logits() then only finishes them (the verify rows' fill and that thread:
verify_rows.py). The device op is one in-place masked fill when the structured rows are
consecutive (batch 1, or every sequence structured), without the fallback when no other control
changed the logits.

draft_mask(): the same grammars for a model drafter's loop (draft_mask.py), so its drafts follow
them too; None when no sequence that drafts this step has one.

grammar_drafts(): a proposer's next drafts under the grammar (forced_drafts.py): cut at the first
one the grammar rejects where that is exact (greedy requests, and sampled requests whose drafts
carry no distribution, such as n-gram's), replaced where the grammar forces another token, and
the grammar's forced run (llguidance's fast-forward tokens) appended after them, past the
proposer's k. A sampled draft from a distribution q must stay (rejection sampling at a draft the
mask forbids draws from the residual max(0, p - q), which keeps the target's distribution;
dropping it would not); forced drafts appended after such drafts get a one-hot q. With
forced_drafts off (speculative_config structured_forced_drafts) the drafts are only cut, where
that is exact, and never pass k: the form before forced drafts, kept for A/B runs.

The tokenizer (the runner's own copy, for llguidance's token table) is loaded when a request first
asks for structured outputs. A sequence's matcher is a deep copy of one kept per grammar (the last
MAX_CACHED_GRAMMARS used): llguidance's copies share the lexer states built lazily as masks are
computed, so a request with a grammar seen before skips both the compilation and that build (on the
default family's JSON schema a document's masks come far faster from a copy of a used matcher than
from a fresh one: docs/perf-log.md, "Figures moved from docstrings").
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict

import numpy as np
import torch

from foretell.device_util import to_device
from foretell.engine.errors import SequenceError
from foretell.structured.bitmask import (BitmaskBuffer, TokenBitsCache, apply_token_bitmask, contiguous_rows,
                                         num_mask_words)
from foretell.structured.draft_mask import DraftMask, MaskTimer
from foretell.structured.forced_drafts import drafts_under_grammar
from foretell.structured.matcher import GrammarViolation, SequenceMatcher
from foretell.structured.verify_rows import VerifyRows

MAX_CACHED_GRAMMARS = 64
# Threads of the llguidance executor: the cores this process may run on, at most this many. Its
# default pool was far slower than an explicit one on a busy 2-core box (docs/perf-log.md,
# "Figures moved from docstrings"); a step has few sequences, so a few threads suffice.
MAX_MASK_THREADS = 8


class StructuredOutputs:
    def __init__(self, tokenizer_source: str | None, vocab_size: int, forced_drafts: bool = True):
        self.tokenizer_source = tokenizer_source  # a folder or Hub id (foretell.tokenizer.Tokenizer)
        self.vocab_size = vocab_size  # the target's logits width
        self.forced_drafts = forced_drafts  # grammar_drafts: forced tokens drafted (else cut only)
        self.matchers: dict[int, SequenceMatcher] = {}  # seq_id ->
        self._ll_tokenizer = None
        self.num_words = num_mask_words(vocab_size)
        self._executor = None  # llguidance.LLExecutor: fills a step's masks in one call
        self._grammars: OrderedDict[str, object] = OrderedDict()  # compiled grammar -> llguidance.LLMatcher
        self._buffers: dict[str, BitmaskBuffer] = {}  # "verify" / "draft" -> host rows, reused
        self._token_bits = TokenBitsCache()  # the drafter's vocabulary in mask words (draft_mask.py)
        self.timer = MaskTimer()  # host time spent on masks (verify rows and draft loops)
        self._verify_rows = VerifyRows(self.timer)  # the verify rows' fill, and the thread filling ahead
        self.draft_limit: int | None = None  # the most drafts grammar_drafts() leaves (limit_drafts)
        self.held_back_drafts = True  # grammar_drafts: the token a forced run holds back drafted too (forced_tail)

    # ---- matchers ------------------------------------------------------------------------
    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            from foretell.tokenizer import Tokenizer

            if self.tokenizer_source is None:
                raise ValueError("structured outputs need the model's tokenizer, and this runner has none")
            hf = Tokenizer(self.tokenizer_source).hf
            n_vocab = max(self.vocab_size, len(hf))
            self.num_words = num_mask_words(n_vocab)
            self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab)
        return self._ll_tokenizer

    def matcher_for(self, seq) -> SequenceMatcher:
        """The sequence's matcher, advanced through its output tokens so far."""
        self._verify_rows.wait_for_worker()  # the matchers are the worker's until it is done
        matcher = self.matchers.get(seq.seq_id)
        try:
            if matcher is None:
                import llguidance

                tokenizer = self._tokenizer()
                params = seq.sampling_params.structured_outputs
                eos = [t for t in seq.eos_token_ids if t < self.num_words * 32]
                matcher = SequenceMatcher(self._new_matcher(params.compiled), eos, tokenizer.eos_token, self.num_words)
                self.matchers[seq.seq_id] = matcher
            matcher.advance(seq.output_token_ids)
        except GrammarViolation as e:
            raise SequenceError(seq.seq_id, f"structured outputs of request {seq.request_id!r}: {e}") from e
        return matcher

    def forget(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def _new_matcher(self, grammar: str):
        """A fresh llguidance matcher at the grammar's start: a copy of the one kept for it."""
        import llguidance

        template = self._grammars.pop(grammar, None)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer(), grammar)
            if template.is_error():  # not kept: every request would fail the same way
                return template
        self._grammars[grammar] = template  # the most recently used last
        while len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return template.deep_copy()

    @property
    def executor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=max(1, min(len(os.sched_getaffinity(0)), MAX_MASK_THREADS)))
        return self._executor

    def buffer(self, name: str, device: torch.device) -> BitmaskBuffer:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.num_words != self.num_words or buffer.device != torch.device(device):
            buffer = self._buffers[name] = BitmaskBuffer(self.num_words, device)
        return buffer

    # ---- the step ------------------------------------------------------------------------
    @staticmethod
    def any_structured(items: list) -> bool:
        return any(item.seq.sampling_params.structured_outputs is not None for item in items)

    def mask_logits(
        self,
        logits: torch.Tensor,  # [sampling rows, vocab] float32: 1 + k rows per sampling sequence, in order
        items: list,  # ScheduledSequence of each sampling sequence, in row order
        copy: bool,  # mask a copy (the caller still reads `logits` unmasked)
        fallback: torch.Tensor | None = None,  # [sampling rows, vocab]: before other controls
    ) -> torch.Tensor:
        """The logits with every structured row's grammar mask applied (`logits` itself when no
        sequence of the step has structured outputs). A row the other controls leave with no
        allowed token takes `fallback`'s logits under the mask (bitmask.apply_token_bitmask);
        fallback `logits` itself (no other control changed them) is no fallback."""
        spans, row0 = [], 0
        for item in items:
            num_rows = len(item.draft_token_ids) + 1
            if item.seq.sampling_params.structured_outputs is not None:
                spans.append((item, row0, num_rows))
            row0 += num_rows
        ahead = self.take_filled_ahead()
        if not spans:
            return logits
        started = time.perf_counter()
        buffer, bitmask = self.fill_verify_rows([item for item, _, _ in spans], ahead, logits.device)
        num_masked = bitmask.shape[0]
        filled = time.perf_counter()
        if copy:
            logits = logits.clone()
        if fallback is logits:
            fallback = None
        row_list = [r for _, first, n in spans for r in range(first, first + n)]
        rows = None if num_masked == logits.shape[0] else contiguous_rows(row_list)
        if rows is None and num_masked != logits.shape[0]:
            rows = to_device(row_list, torch.int64, logits.device)
        apply_token_bitmask(logits, rows, buffer.to_device(num_masked), fallback)
        done = time.perf_counter()
        self.timer.verify_fill_seconds += filled - started
        self.timer.verify_apply_seconds += done - filled
        self.timer.seconds += done - started
        return logits

    def take_filled_ahead(self) -> tuple | None:
        """The rows the worker filled ahead for this step (None: none): VerifyRows.take_filled_ahead."""
        return self._verify_rows.take_filled_ahead()

    def fill_verify_rows(self, items: list, ahead: tuple | None,
                         device: torch.device) -> tuple[BitmaskBuffer, np.ndarray]:
        """The verify rows of `items` (structured sequences that sample, in row order: each one's
        len(drafts) + 1 rows, row j as if drafts d_0..d_{j-1} were accepted) in the reusable
        "verify" host buffer (VerifyRows.fill). Returns the buffer and its rows [sum, words] int32."""
        matchers = [self.matcher_for(item.seq) for item in items]  # first: the mask width is known after
        buffer = self.buffer("verify", device)
        bitmask = buffer.rows(sum(len(item.draft_token_ids) + 1 for item in items))  # [rows, words]
        self._verify_rows.fill(items, matchers, ahead, bitmask, self.executor)
        return buffer, bitmask

    def fill_ahead(self, scheduled: list, results: list) -> None:
        """Start filling the next step's verify rows on the worker thread (VerifyRows.fill_ahead);
        the matchers are not touched by anything else until the worker is done."""
        self._verify_rows.fill_ahead(scheduled, results, self.matchers, self.num_words, lambda: self.executor)

    def close(self) -> None:
        """Wait for the rows being filled ahead, then end the worker thread."""
        self._verify_rows.close()

    def draft_mask(self, scheduled: list, results: list, device: torch.device) -> DraftMask | None:
        """The grammars of this step's drafting sequences, advanced through the tokens the step
        emits (results[i].new_token_ids), for the drafter's loop; None when none has one."""
        matchers: list[SequenceMatcher | None] = []
        for item, result in zip(scheduled, results):
            seq = item.seq
            if seq.sampling_params.structured_outputs is None or not item.samples:
                matchers.append(None)
                continue
            matcher = self.matcher_for(seq)
            try:
                matcher.advance(seq.output_token_ids + list(result.new_token_ids))
            except GrammarViolation as e:
                raise SequenceError(seq.seq_id, f"structured outputs of request {seq.request_id!r}: {e}") from e
            matchers.append(matcher)
        if all(m is None for m in matchers):
            return None
        return DraftMask(matchers, self.executor, self.buffer("draft", device), self.timer, self._token_bits)

    def limit_drafts(self, k: int) -> None:
        """Hold every grammar_drafts() result to at most k drafts: called once, when the padded
        verify step that takes grammar requests is built (it verifies at most K drafts a sequence,
        structured/padded_verify.py), so a forced run appended on the host step does not send the
        sequence's next verify back to the host step."""
        self.draft_limit = k

    def grammar_drafts(self, scheduled: list, results: list, draft_probs: list,
                       max_drafts: int | None) -> list[torch.Tensor | None]:
        """Each structured sequence's next drafts (results[i].next_drafts) under its grammar after
        this step's tokens (forced_drafts.drafts_under_grammar): cut at the first draft it rejects
        where that is exact, replaced where it forces another token (deterministic or greedy
        drafts), and its forced run appended after the drafts it takes, at most max_drafts in all
        (None: unbounded). draft_probs[i]: the proposer's draft distribution [k, vocab] for
        sequence i, or None; returns them with a one-hot row for each appended forced draft of a
        sampled request (the drafts of a greedy one need none). With forced_drafts off, only the
        cut (drawn drafts untouched), and the probabilities come back as they were."""
        out = list(draft_probs)
        started = time.perf_counter()
        if self.draft_limit is not None:
            max_drafts = self.draft_limit if max_drafts is None else min(max_drafts, self.draft_limit)
        for i, (item, result, probs) in enumerate(zip(scheduled, results, draft_probs)):
            seq = item.seq
            params = seq.sampling_params
            if params.structured_outputs is None or not item.samples or result.next_drafts is None:
                continue
            matcher = self.matcher_for(seq)
            try:
                matcher.advance(seq.output_token_ids + list(result.new_token_ids))
            except GrammarViolation as e:
                raise SequenceError(seq.seq_id, f"structured outputs of request {seq.request_id!r}: {e}") from e
            drawn = probs is not None and not params.greedy  # drafts drawn from a distribution
            drafts = list(result.next_drafts)
            if not self.forced_drafts:
                if not drawn and drafts:
                    result.next_drafts = drafts[: matcher.allowed_prefix(drafts)]
                continue
            shaped = drafts_under_grammar(matcher, drafts, not drawn, max_drafts,
                                          self._tokenizer().tokenize_bytes if self.held_back_drafts else None)
            result.next_drafts = shaped.token_ids
            self.timer.forced_drafts += shaped.num_forced
            self.timer.replaced_drafts += shaped.num_replaced
            self.timer.held_back_drafts += shaped.num_held_back
            if drawn and shaped.num_forced:  # drawn drafts are never cut or replaced: appended only
                forced = to_device(shaped.token_ids[len(drafts):], torch.int64, probs.device)  # [forced]
                one_hot = probs.new_zeros(len(forced), probs.shape[-1]).scatter_(1, forced[:, None], 1.0)  # [forced, vocab]
                out[i] = torch.cat([probs[: len(drafts)], one_hot])  # [drafts + forced, vocab]
        elapsed = time.perf_counter() - started
        self.timer.forced_seconds += elapsed
        self.timer.seconds += elapsed
        return out
