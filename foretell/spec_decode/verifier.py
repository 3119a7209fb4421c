"""The Verifier: how many of its drafts each sequence of a verify step accepts, and the token after
them. The runner builds one when it is built (build_verifier) and never asks which it has:

  ExactVerifier      what the target itself would emit: greedy rows accept the longest prefix of
                     drafts equal to the target's argmax; sampled rows go through rejection
                     sampling (rejection_sampler.py), which keeps the target's distribution.
  SimulatedVerifier  accept counts drawn at configured rates (simulated_acceptance.py), for
                     benchmarking at real sizes without trained drafters; the text is synthetic.

Each has the two input forms of the step: `accept_padded` for the padded device step
(runner/graphed_verify.py: [B, k + 1] greedy tokens on the device, results written into the draft
loop's static buffers, one launch on CUDA) and `sample_padded` for a padded step with sampled rows
(rejection sampling over the [B, k + 1, vocab] logits, the noise from keys and positions on the
device: the same tokens as `verify` for seeded rows), and `verify` for a step built from host
lists (any mix of draft counts, sampled rows with draft probabilities, logprobs). `accept_limits` /
`caps` bound what a sequence may accept near its max_tokens. `verify_greedy` is `verify` for a
step of greedy rows only given the target's greedy tokens instead of its logits (under tensor
parallelism: picked without gathering the vocabulary, runner/host_step.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from foretell.device_util import to_device
from foretell.layers.sampler import NoiseSource, SamplingBatch, argmax_rows
from foretell.ops.step.dispatch import accept_drafts, accept_drawn, drawn_accepted
from foretell.spec_decode.rejection_sampler import (
    PaddedSampling,
    RejectionSampler,
    VerifyResult,
    cap_accepted,
    greedy_acceptance,
    sample_padded,
)
from foretell.spec_decode.simulated_acceptance import ROW_STRIDE, SimulatedAcceptance, rates_from_config


class Verifier(Protocol):
    #: Whether accept decisions are drawn rather than verified (the output text is synthetic).
    synthetic: bool

    def verify(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32: k_i + 1 rows per sequence, in order
        draft_token_ids: list[list[int]],  # per sequence, k_i drafts
        draft_probs: list[torch.Tensor | None],  # per sequence [k_i, vocab], or None (deterministic drafts)
        sampling: SamplingBatch,  # one entry per logits row
        accept_limits: list[int | None],  # per sequence: most drafts it may accept, or None
    ) -> VerifyResult:
        """The step from host lists; results on the host."""
        ...

    def verify_greedy(
        self,
        greedy: torch.Tensor,  # [rows] int64: the target's greedy token at each row, k_i + 1 per sequence
        draft_token_ids: list[list[int]],  # per sequence, k_i drafts
        accept_limits: list[int | None],  # per sequence: most drafts it may accept, or None
    ) -> VerifyResult:
        """`verify` of greedy rows from their tokens: the same result, no logits needed."""
        ...

    def accept_padded(
        self,
        greedy: torch.Tensor,  # [B, k + 1] int64: the target's greedy token at each verify row
        drafts: torch.Tensor | None,  # [B, k] int64: the drafts verified (a drawn verifier reads none)
        caps: torch.Tensor | None,  # [B] int64: most drafts each may accept, or None
        accepted_out: torch.Tensor,  # [>= B] int64, written
        next_token_out: torch.Tensor,  # [>= B] int64, written
        num_live_out: torch.Tensor,  # 0-d int64, set to B
    ) -> None:
        """The padded greedy step, on the device, waiting for nothing."""
        ...

    def sample_padded(
        self,
        logits: torch.Tensor,  # [B, k + 1, vocab] float32: the target's logits at each verify row
        greedy: torch.Tensor,  # [B, k + 1] int64: their argmax
        drafts: torch.Tensor,  # [B, k] int64
        draft_probs: torch.Tensor | None,  # [B, k, vocab] float32, or None: deterministic drafts
        rows: PaddedSampling,  # the rows' sampling parameters and noise keys
        first_positions: torch.Tensor,  # [B] int64: each sequence's first verify position
        caps: torch.Tensor | None,  # [B] int64, or None
        accepted_out: torch.Tensor,  # [>= B] int64, written
        next_token_out: torch.Tensor,  # [>= B] int64, written
        num_live_out: torch.Tensor,  # 0-d int64, set to B
        lengths: torch.Tensor | None = None,  # [B] int64: real drafts per sequence (<= k), None: all k
    ) -> None:
        """The padded step with sampled rows (greedy rows as accept_padded), on the device,
        waiting for nothing. A sequence with fewer real drafts than the step's k (padded) has
        caps <= lengths: greedy and drawn acceptance stop there; a sampled row draws its bonus
        token at its own row (rejection_sampler.sample_padded)."""
        ...


class ExactVerifier:
    synthetic = False

    def __init__(self, noise: NoiseSource):
        self.rejection_sampler = RejectionSampler(noise)

    def verify(self, logits, draft_token_ids, draft_probs, sampling, accept_limits) -> VerifyResult:
        verify = self.rejection_sampler(logits, draft_token_ids, draft_probs, sampling)
        return cap_accepted(verify, accept_limits)

    def verify_greedy(self, greedy, draft_token_ids, accept_limits) -> VerifyResult:
        num_seqs, lengths = len(draft_token_ids), [len(d) for d in draft_token_ids]
        starts, row_index = padded_rows(lengths)
        drafts = to_device([d + [0] * (max(lengths) - len(d)) for d in draft_token_ids], torch.int64, greedy.device)
        accepted, finals = greedy_acceptance(greedy[to_device(row_index, torch.int64, greedy.device)],
                                             drafts.view(num_seqs, max(lengths)),
                                             to_device(lengths, torch.int64, greedy.device))
        counts, tokens = torch.stack([accepted, finals]).tolist()  # one sync
        return cap_accepted(VerifyResult.from_counts(draft_token_ids, starts, counts, tokens, greedy.device),
                            accept_limits)

    def accept_padded(self, greedy, drafts, caps, accepted_out, next_token_out, num_live_out) -> None:
        accept_drafts(greedy, drafts, caps, accepted_out, next_token_out, num_live_out)

    def sample_padded(self, logits, greedy, drafts, draft_probs, rows, first_positions, caps, accepted_out,
                      next_token_out, num_live_out, lengths=None) -> None:
        accept_drafts(greedy, drafts, caps, accepted_out, next_token_out, num_live_out)  # the greedy rows'
        n, q = greedy.shape
        sampled = ~rows.sampling.greedy_rows.view(n, q)[:, 0]  # [n] bool
        accepted, next_token = sample_padded(logits, drafts, draft_probs, rows, first_positions, caps, lengths)
        accepted_out[:n] = torch.where(sampled, accepted, accepted_out[:n])
        next_token_out[:n] = torch.where(sampled, next_token, next_token_out[:n])


class SimulatedVerifier:
    synthetic = True

    def __init__(self, draws: SimulatedAcceptance, noise: NoiseSource):
        self.draws = draws
        self.rejection_sampler = RejectionSampler(noise)

    def verify(self, logits, draft_token_ids, draft_probs, sampling, accept_limits) -> VerifyResult:
        # Rejection sampling still runs (it draws the same noise as without simulation); only the
        # accept counts are replaced, by the padded step's drawn acceptance on the sequences' rows
        # (padded to k + 1 by repeating each sequence's last row, capped at its own drafts): the
        # token after the accepted drafts is the target's greedy choice at that row.
        verify = self.rejection_sampler(logits, draft_token_ids, draft_probs, sampling)
        starts = [rows[0] for rows in verify.emitted_rows]
        return self._drawn(argmax_rows(logits), draft_token_ids, starts, accept_limits)

    def _drawn(self, greedy_rows: torch.Tensor, draft_token_ids, starts, accept_limits) -> VerifyResult:
        """The drawn accept counts over greedy_rows [rows] int64 (the target's greedy tokens)."""
        device = greedy_rows.device
        width = len(self.draws.rates) + 1
        lengths = [len(d) for d in draft_token_ids]
        row_index = [[start + min(i, n) for i in range(width)] for start, n in zip(starts, lengths)]
        greedy = greedy_rows[to_device(row_index, torch.int64, device)]  # [num_seqs, k + 1]
        start, rates = self.draws.device_step(device)
        accepted, next_token = drawn_accepted(greedy, start, rates, ROW_STRIDE, to_device(lengths, torch.int64, device))
        counts, finals = torch.stack([accepted, next_token]).tolist()  # one sync
        drawn = VerifyResult.from_counts(draft_token_ids, starts, counts, finals, device)
        return cap_accepted(drawn, accept_limits)

    def verify_greedy(self, greedy, draft_token_ids, accept_limits) -> VerifyResult:
        # As verify() on greedy rows: rejection sampling draws no noise for them.
        return self._drawn(greedy, draft_token_ids, padded_rows([len(d) for d in draft_token_ids])[0], accept_limits)

    def accept_padded(self, greedy, drafts, caps, accepted_out, next_token_out, num_live_out) -> None:
        start, rates = self.draws.device_step(greedy.device)
        # A step verifying k < K drafts (adaptive speculation) counts the first k rates: the same
        # as the host step's count capped at k (the rates do not increase).
        rates = rates[: greedy.shape[1] - 1]
        accept_drawn(greedy, start, rates, ROW_STRIDE, caps, accepted_out, next_token_out, num_live_out)

    def sample_padded(self, logits, greedy, drafts, draft_probs, rows, first_positions, caps, accepted_out,
                      next_token_out, num_live_out, lengths=None) -> None:
        # As verify(): the drawn counts and the target's greedy token after them, sampled or not.
        self.accept_padded(greedy, drafts, caps, accepted_out, next_token_out, num_live_out)


def padded_rows(lengths: list[int]) -> tuple[list[int], list[list[int]]]:
    """(each sequence's first row, [num_seqs, max_k + 1] row of each padded position) for
    sequences of lengths[i] drafts and lengths[i] + 1 rows each; padding repeats the last row."""
    starts = [0]
    for k in lengths:
        starts.append(starts[-1] + k + 1)
    width = max(lengths, default=0) + 1
    return starts[:-1], [[start + min(i, k) for i in range(width)] for start, k in zip(starts, lengths)]


def build_verifier(spec, noise: NoiseSource, seed: int) -> Verifier:
    """The verifier for a SpeculativeConfig (or None: no speculation, exact)."""
    if spec is not None and spec.simulate_acceptance is not None:
        rates = rates_from_config(spec.simulate_acceptance, spec.num_speculative_tokens)
        return SimulatedVerifier(SimulatedAcceptance(rates, seed), noise)
    return ExactVerifier(noise)
