"""Grammars on the padded verify step (runner/graphed_verify.py, issue 27): a request with
structured outputs verifies on the target's padded (bucket, q) forward and drafts on the draft
loop's graph like a request without, instead of the host step's eager draft loop, whose grammar
masks each draft position (on the H200 with EAGLE3: ~215 launches and 4 syncs a step, many times the
padded step's time: docs/perf-log.md, issue 27).

One grammar step, in order (GraphedVerify.launch, then LaunchedVerify.read):
  1. the target's forward is launched first (a graph replay on CUDA: the device computes while
     the host fills the masks);
  2. the verify rows' bitmasks on the host: each structured sequence's len(drafts) + 1 rows, row j
     as if drafts d_0..d_{j-1} were accepted (StructuredOutputs.fill_verify_rows: usually the rows
     the worker thread filled ahead at the end of the last step), laid out as the padded step's
     rows (sequence i at rows i * q .. i * q + q - 1; its padding rows repeat its last real row;
     the rows of a sequence without a grammar allow every token) in a host buffer (pinned on
     CUDA), then one copy into a static device buffer (GrammarMaskBuffer);
  3. on the device (PaddedVerifyGrammar.apply): -inf where a row's bit is 0, on the logits
     verification reads, after the other logits controls (with the host step's fallback for a row
     they leave with nothing allowed: bitmask.apply_token_bitmask); each row's greedy pick taken
     again from them; then verification as for any request (greedy acceptance, or rejection
     sampling over the masked logits), and the logprobs, which stay the raw logits' as on the
     host step;
  4. the draft loop on its graph, unconstrained (the drafter's argmax over its whole vocabulary);
  5. the step's one read of its results (accepted counts, next tokens, drafts);
  6. on the host (PaddedVerifyGrammar.after_read): each structured sequence's next drafts under
     its grammar (StructuredOutputs.grammar_drafts), then the next step's verify rows handed to
     the worker thread (fill_ahead). With speculative_config structured_forced_drafts on (the
     default), the drafts are replaced from the first position where the grammar forces another
     token, cut at the first one it rejects, and the grammar's forced run (JSON syntax, a schema's
     keys) appended after the last one it takes; off, they are only cut. Either way at most K in
     all (StructuredOutputs.limit_drafts: the padded step verifies at most K drafts a sequence;
     the host step's forced runs stop there too).
Such a step is never queued ahead of the host (the next step's masks need this step's accepted
tokens): one device->host sync a step, the read, and one upload of the masks.

Exactness. Greedy: verification reads the masked logits, so the tokens are masked greedy
decoding's whatever the drafts are, the host step's tokens exactly; the drafts themselves differ
from the host step's (there each position of the drafter is masked), which changes acceptance
only. Sampled: the draft loop's drafts and the forced drafts are deterministic (a one-hot q:
exact), and drafts the host step drew from a distribution keep it (GraphedVerify takes them with
their probabilities and never cuts them), so rejection sampling keeps the masked target's
distribution.

A host drafter (n-gram, suffix) verifies grammar requests on the padded step too (its draft loop
is runner/host_drafts.HostDraftSlots, which drafts nothing): steps 1-3 and 5 as above, and step 6
after the read, once the drafter has proposed from the host's token lists
(host_drafts.propose_from_tokens shapes those drafts and starts the next rows' fill).

Plain decoding without a drafter masks its grammar requests on its own device step with the same
pieces (runner/decode_ahead.py: padded_verify_grammar with q = 1, PaddedVerifyGrammar.apply; the
next rows' fill started after its read). What stays on the host step: grammar requests of every
batch neither step takes (prefill chunks, trees, tensor parallelism on the padded step; plain
decoding with async scheduling off).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from foretell.structured.bitmask import apply_token_bitmask
from foretell.structured.runtime import StructuredOutputs


class GrammarMaskBuffer:
    """The padded step's mask rows: a host buffer the host lays them out in (pinned on CUDA) and a
    static device buffer they are copied into, both [max_rows, words] int32, made at the first
    grammar step (again if the mask width changes: a tokenizer larger than the logits)."""

    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows = max_rows  # the padded forward's most rows (largest bucket x q)
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.host: torch.Tensor | None = None  # [max_rows, words] int32
        self.on_device: torch.Tensor | None = None  # [max_rows, words] int32
        self._copied = None  # CUDA event after the last copy out of `host`

    def host_rows(self, num_rows: int, num_words: int) -> np.ndarray:
        """[num_rows, num_words] int32 host rows to write (the last copy out of them is done)."""
        if num_rows > self.max_rows:
            raise ValueError(f"a padded step of {num_rows} rows, more than the padded forward's {self.max_rows}")
        if self.host is None or self.host.shape[1] != num_words:
            self.host = torch.empty((self.max_rows, num_words), dtype=torch.int32, pin_memory=self.pinned)
            self.on_device = torch.empty((self.max_rows, num_words), dtype=torch.int32, device=self.device)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.host[:num_rows].numpy()

    def upload(self, num_rows: int) -> torch.Tensor:
        """The first num_rows host rows copied into the device buffer: its view [num_rows, words]."""
        rows = self.on_device[:num_rows]
        rows.copy_(self.host[:num_rows], non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return rows


def padded_verify_grammar(structured: StructuredOutputs, buffer: GrammarMaskBuffer, items: list, q: int,
                          max_drafts: int, shapes_drafts: bool = True) -> "PaddedVerifyGrammar | None":
    """The grammar of a padded step of q rows per sequence (items: the ScheduledSequence of each,
    in row order, each with at most q - 1 drafts), its masks on the device; None when no sequence
    has structured outputs. shapes_drafts False: a host drafter's step, whose drafts are proposed
    and shaped after the read (host_drafts.propose_from_tokens), not by after_read."""
    structured_items = [item for item in items if item.seq.sampling_params.structured_outputs is not None]
    if not structured_items:
        return None  # rows filled ahead for other steps are keyed (fill_verify_rows checks them)
    ahead = structured.take_filled_ahead()
    started = time.perf_counter()
    _, compact = structured.fill_verify_rows(structured_items, ahead, buffer.device)  # [sum(k_i + 1), words]
    filled = time.perf_counter()
    rows = buffer.host_rows(len(items) * q, compact.shape[1])  # [n * q, words]
    first = 0
    for i, item in enumerate(items):
        span = rows[i * q: (i + 1) * q]
        if item.seq.sampling_params.structured_outputs is None:
            span.fill(-1)  # every token allowed
            continue
        num_real = len(item.draft_token_ids) + 1
        span[:num_real] = compact[first: first + num_real]
        span[num_real:] = compact[first + num_real - 1]  # padding rows: never emitted from
        first += num_real
    bitmask = buffer.upload(len(items) * q)  # [n * q, words] on the device
    structured.timer.verify_fill_seconds += filled - started
    structured.timer.verify_apply_seconds += time.perf_counter() - filled
    structured.timer.seconds += time.perf_counter() - started
    return PaddedVerifyGrammar(structured, items, bitmask, max_drafts, shapes_drafts)


@dataclass
class PaddedVerifyGrammar:
    """One padded step's grammar: its rows' masks on the device, and the drafts it shapes after
    the step's read (the module docstring says when each runs)."""

    structured: StructuredOutputs
    items: list  # the step's ScheduledSequence, in row order
    bitmask: torch.Tensor  # [n * q, words] int32 on the device
    max_drafts: int  # K: the most drafts a sequence's next verify holds
    shapes_drafts: bool = True  # False: a host drafter's (its drafts come after the read)

    def apply(self, logits: torch.Tensor, raw_logits: torch.Tensor) -> torch.Tensor:
        """The logits verification reads, masked: logits [n, q, vocab] float32 is raw_logits
        itself (no other control: masked into a new tensor, the logprobs read the raw ones) or the
        controls' processed copy (masked in place, a row they leave with nothing the grammar
        allows taking raw_logits' under the mask)."""
        started = time.perf_counter()
        n, q, vocab = logits.shape
        flat = logits.view(n * q, vocab)
        if logits is raw_logits:
            masked = flat.clone()  # [n * q, vocab]
            apply_token_bitmask(masked, None, self.bitmask)
        else:
            apply_token_bitmask(flat, None, self.bitmask, raw_logits.view(n * q, vocab))
            masked = flat
        elapsed = time.perf_counter() - started
        self.structured.timer.verify_apply_seconds += elapsed
        self.structured.timer.seconds += elapsed
        return masked.view(n, q, vocab)

    def after_read(self, results: list) -> None:
        """After the step's read (results: each sequence's SequenceResult, next_drafts the draft
        loop's): the structured sequences' next drafts under their grammars, at most max_drafts
        (forced drafts per structured_forced_drafts), and their next verify rows started on the
        worker thread. The drafts are deterministic (no probabilities). A host drafter's step
        (shapes_drafts False) does both after its drafter proposes (propose_from_tokens)."""
        if not self.shapes_drafts:
            return
        self.structured.grammar_drafts(self.items, results, [None] * len(self.items), self.max_drafts)
        self.structured.fill_ahead(self.items, results)
