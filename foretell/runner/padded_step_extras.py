"""What the padded verify step (runner/graphed_verify.py) does for the sequences that ask beyond
verifying their drafts: logits controls before verification and logprobs after it, both on the
device inside the step, both leaving with the step's one read-back.

Logits controls (runner/padded_logits_controls.py): the sequences that have some (penalties,
logit_bias, min_tokens, bad words, allowed tokens) carry their state on the device (output counts,
bias and allow tables, min_tokens counts, bad words' last tokens), built from the host's lists when
a step is launched from host inputs and advanced by the step's own emitted tokens right after its
verification, so a step queued ahead processes its logits as the host step would; every verify
row is processed as if the drafts before it had been accepted, and verification (greedy acceptance
over the processed logits' argmax, or rejection sampling over them) reads the processed logits.

Logprobs (runner/logprobs.py's padded_step_logprobs): after verification, the device takes the
log-softmax of the target's raw logits (the host step's raw_logits: before logits processing) at
every verify row of the sequences that ask, the top-n of the most any of them asks for, and the
log-prob of the token each row emits (draft j + 1 while j < accepted, then the next token), into a
static buffer (PackedLogprobBuffer) that leaves with the accepted counts, next tokens and drafts in
the step's one read-back; the host keeps each sequence's emitted rows (as many as the host step
reports: accepted + 1) and its own top-n. Prompt logprobs come from prefill rows: the host step.

Grammars (structured/padded_verify.py): the verify rows' bitmasks, filled on the host and
uploaded when the step is launched, applied after the controls (verification reads the masked
logits); after the step's read, the structured sequences' next drafts shaped by their grammars.
A step with a grammar is never queued ahead.

PaddedStepExtras is one step's set of them (None where no sequence asks); a step queued after
another reuses its extras, their device state advanced by the earlier step's verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foretell.engine.sequence import Sequence
from foretell.layers.sampler import argmax_rows
from foretell.runner.logprobs import PaddedLogprobs, padded_step_logprobs, read_padded_logprobs
from foretell.runner.padded_logits_controls import PaddedLogitsControls
from foretell.runner.sequence_result import SequenceResult
from foretell.structured.padded_verify import PaddedVerifyGrammar


class PackedLogprobBuffer:
    """The int64 buffer a step's logprobs are packed into (padded_step_logprobs): made at the first
    step that asks and grown when a step asks for more alternatives. The read-back copies from it
    beside the stream (graph_inputs.SideStream.download_outputs), so it outlives the copy."""

    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows = max_rows  # the padded forward's most rows (largest bucket x q)
        self.device = device
        self.buffer: torch.Tensor | None = None  # [max_rows * row_width] int64 once made

    def for_width(self, row_width: int) -> torch.Tensor:
        """The buffer, grown to max_rows rows of row_width when too small. Called after the
        step's before_output_write: the last read-back from an old buffer is done when anything the
        stream runs next reuses its memory."""
        if self.buffer is None or self.buffer.numel() < self.max_rows * row_width:
            self.buffer = torch.empty(self.max_rows * row_width, dtype=torch.int64, device=self.device)
        return self.buffer


@dataclass
class PaddedStepExtras:
    """One padded step's logits controls, logprobs and grammars (each None when no sequence has
    any)."""

    logprobs: PaddedLogprobs | None  # which sequences want logprobs, and how many alternatives
    controls: PaddedLogitsControls | None  # the logits controls' device state
    grammar: PaddedVerifyGrammar | None = None  # the grammars' masks (set at launch: GraphedVerify)

    @classmethod
    def for_sequences(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> "PaddedStepExtras":
        """Built from the host's lists (a launch from host inputs: the batch may differ from the
        last step's in any sequence)."""
        return cls(PaddedLogprobs.for_params([seq.sampling_params for seq in seqs], device),
                   PaddedLogitsControls.for_sequences(seqs, vocab_size, device))

    @property
    def reads_logits(self) -> bool:
        """Whether any of them reads the step's logits (a greedy step without them reads only its
        greedy tokens)."""
        return self.controls is not None or self.logprobs is not None or self.grammar is not None

    def process(self, raw_logits: torch.Tensor | None, drafts: torch.Tensor,
                greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits verification reads and each row's greedy token: raw_logits [n, q, vocab]
        float32 and greedy [n, q] as they are without controls or grammars, else processed (a new
        tensor; drafts [n, q - 1]: each row processed as if the drafts before it were accepted),
        the grammars' masks last."""
        if self.controls is None and self.grammar is None:
            return raw_logits, greedy
        n, q, vocab = raw_logits.shape
        logits = raw_logits if self.controls is None else self.controls.apply(raw_logits, drafts)  # [n, q, vocab]
        if self.grammar is not None:
            logits = self.grammar.apply(logits, raw_logits)
        return logits, argmax_rows(logits.view(n * q, vocab)).view(n, q)

    def after_verification(self, raw_logits: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor,
                           next_token: torch.Tensor, out: PackedLogprobBuffer) -> torch.Tensor | None:
        """Once verification decided the emitted tokens (accepted [n], next_token [n]): the
        controls' state advanced past them (what a step queued after this one processes with),
        and the packed logprobs of the sequences that ask ([num_wanting, q, width] in `out`), or
        None."""
        if self.controls is not None:
            self.controls.advance(drafts, accepted, next_token)
        if self.logprobs is None:
            return None
        return padded_step_logprobs(self.logprobs, raw_logits, drafts, accepted, next_token,
                                    out.for_width(self.logprobs.row_width))

    def read(self, q: int, packed: list[int], results: list[SequenceResult]) -> None:
        """After the step's read: each result's logprobs from the packed values read back (the
        rows it emitted), then the grammars' shaping of the next drafts."""
        self.read_logprobs(q, packed, results)
        if self.grammar is not None:
            self.grammar.after_read(results)

    def read_logprobs(self, q: int, packed: list[int], results: list[SequenceResult]) -> None:
        """Each result's logprobs from the packed values read back (the rows it emitted)."""
        if self.logprobs is None:
            return
        per_seq = read_padded_logprobs(self.logprobs, q, packed, [r.new_token_ids for r in results])
        for result, logprobs in zip(results, per_seq):
            result.logprobs = logprobs
