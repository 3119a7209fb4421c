"""The logits controls of a step's sampling rows (SamplingParams: penalties, logit_bias, bad
words, min_tokens, allowed_token_ids), from the host's token lists to the device op
(ops/sampling/penalties.py), at the one point where the target's logits of the sampling rows
exist before the sampler or the verifier (HostStep.sample).

Exact under speculation: a sequence verifying drafts d_0..d_{k-1} has k + 1 rows, and row j is
processed as if d_0..d_{j-1} had been accepted: they count as output tokens (presence, frequency,
repetition), as generated tokens for min_tokens, and as the tokens a bad word's prefix must end
with. Whatever the verifier accepts, the token it emits at a row was drawn (or picked) from the
distribution plain decoding would have used after the same tokens.
"""

from __future__ import annotations

import torch

from foretell.device_util import to_device
from foretell.engine.scheduler import ScheduledSequence
from foretell.ops.sampling.penalties import LogitsControls, apply_logits_controls


def apply_sampling_controls(
    logits: torch.Tensor,  # [sampling rows, vocab] float32: 1 + k rows per sampling sequence, in order
    items: list[ScheduledSequence],  # the sampling sequences, in row order
    keep_raw: bool,  # the caller still needs the unprocessed logits (logprobs are raw)
) -> torch.Tensor:
    """The logits the sampler or verifier should use: `logits` itself when no row has controls,
    else processed (in place, or in a copy with keep_raw)."""
    if not any(item.seq.sampling_params.needs_logits_controls for item in items):  # a grammar alone: nothing to do
        return logits
    controls = build_controls(items, logits.device)
    processed = logits.clone() if keep_raw else logits
    apply_logits_controls(processed, controls)
    return processed


def build_controls(items: list[ScheduledSequence], device: torch.device) -> LogitsControls:
    """The device tensors of the controls of `items`' rows (only the sequences that have some)."""
    lists = _ControlLists()
    row0 = 0
    for item in items:
        drafts = list(item.draft_token_ids)
        params = item.seq.sampling_params
        if params.needs_logits_controls:
            lists.add_sequence(item.seq, drafts, row0)
        row0 += len(drafts) + 1
    return lists.to_device(device)


class _ControlLists:
    """Host lists of a LogitsControls, filled one sequence at a time."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.row_sequence: list[int] = []
        self.presence: list[float] = []
        self.frequency: list[float] = []
        self.repetition: list[float] = []
        self.output_sequence: list[int] = []
        self.output_token_ids: list[int] = []
        self.draft_rows: list[int] = []
        self.draft_token_ids: list[int] = []
        self.prompt_sequence: list[int] = []
        self.prompt_token_ids: list[int] = []
        self.bias_sequence: list[int] = []
        self.bias_token_ids: list[int] = []
        self.bias_values: list[float] = []
        self.banned_rows: list[int] = []
        self.banned_token_ids: list[int] = []
        self.allowed_sequence: list[int] = []
        self.allowed_token_ids: list[int] = []
        self.restricted: list[bool] = []
        self.counts_output = False
        self.any_repetition = False

    def add_sequence(self, seq, drafts: list[int], row0: int) -> None:
        p = seq.sampling_params
        slot = len(self.restricted)
        counts = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        self.counts_output |= counts
        num_output = seq.num_output_tokens
        if counts:
            self.output_sequence.extend([slot] * num_output)
            self.output_token_ids.extend(seq.output_token_ids)
        if p.repetition_penalty != 1.0:
            self.any_repetition = True
            self.prompt_sequence.extend([slot] * seq.num_prompt_tokens)
            self.prompt_token_ids.extend(seq.prompt_token_ids)
        for token, value in (p.logit_bias or {}).items():
            self.bias_sequence.append(slot)
            self.bias_token_ids.append(token)
            self.bias_values.append(value)
        self.restricted.append(p.allowed_token_ids is not None)
        for token in p.allowed_token_ids or []:
            self.allowed_sequence.append(slot)
            self.allowed_token_ids.append(token)
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(seq.eos_token_ids))
        bad_words = p.bad_words_token_ids or []
        longest = max((len(w) for w in bad_words), default=1)
        # The last tokens before row 0 (the most any bad word's prefix needs), then the drafts.
        tail = seq.token_ids[max(0, len(seq.token_ids) - (longest - 1)):] if longest > 1 else []
        tail = tail + drafts
        base = len(tail) - len(drafts)
        for j in range(len(drafts) + 1):
            row = len(self.rows)
            self.rows.append(row0 + j)
            self.row_sequence.append(slot)
            self.presence.append(p.presence_penalty)
            self.frequency.append(p.frequency_penalty)
            self.repetition.append(p.repetition_penalty)
            if counts:
                self.draft_rows.extend([row] * j)
                self.draft_token_ids.extend(drafts[:j])
            banned = set()
            if num_output + j < p.min_tokens:
                banned.update(stop_ids)
            before = tail[: base + j]  # the tokens just before this row's token (the last ones)
            for word in bad_words:
                prefix = word[:-1]
                if not prefix or (len(prefix) <= len(before) and before[len(before) - len(prefix):] == prefix):
                    banned.add(word[-1])
            self.banned_rows.extend([row] * len(banned))
            self.banned_token_ids.extend(sorted(banned))

    def to_device(self, device: torch.device) -> LogitsControls:
        def ids(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, device)

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        return LogitsControls(
            rows=ids(self.rows),
            row_sequence=ids(self.row_sequence),
            num_sequences=len(self.restricted),
            presence=floats(self.presence),
            frequency=floats(self.frequency),
            repetition=floats(self.repetition),
            output_sequence=ids(self.output_sequence),
            output_token_ids=ids(self.output_token_ids),
            draft_rows=ids(self.draft_rows),
            draft_token_ids=ids(self.draft_token_ids),
            prompt_sequence=ids(self.prompt_sequence),
            prompt_token_ids=ids(self.prompt_token_ids),
            bias_sequence=ids(self.bias_sequence),
            bias_token_ids=ids(self.bias_token_ids),
            bias_values=floats(self.bias_values),
            banned_rows=ids(self.banned_rows),
            banned_token_ids=ids(self.banned_token_ids),
            allowed_sequence=ids(self.allowed_sequence),
            allowed_token_ids=ids(self.allowed_token_ids),
            restricted_sequences=to_device(self.restricted, torch.bool, device),
            counts_output=self.counts_output,
            any_repetition=self.any_repetition,
            any_bias=bool(self.bias_values),
            any_allowed=any(self.restricted),
        )
