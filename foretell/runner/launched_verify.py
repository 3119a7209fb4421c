"""A padded verify step on its way (LaunchedVerify): queued on the device by GraphedVerify
(graphed_verify.py), its accepted counts, next tokens and next drafts read back to the host
when the step pipeline (step_pipeline.py) asks; a step queued after it learns what it verifies
from its results (expect), and the scheduler's next decision is checked against it (matches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.runner.padded_step_extras import PaddedStepExtras
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import HostCopy
from foretell.spec_decode.rejection_sampler import PaddedSampling

if TYPE_CHECKING:
    from foretell.runner.graphed_verify import GraphedVerify
    from foretell.runner.host_drafts import DrafterRows


@dataclass
class LaunchedVerify:
    """A padded verify step queued on the device whose results the host has not read yet."""

    kind: "GraphedVerify"  # what launched it, and launches the step after it
    seqs: list[Sequence]
    key: tuple[int, int]  # (batch bucket, k + 1)
    accepted: torch.Tensor  # [num_seqs] int64 on the device
    next_token: torch.Tensor  # [num_seqs] int64
    drafts: torch.Tensor  # [num_seqs, m] int64: the drafts for the step after this one
    copy: HostCopy  # of [accepted, next_token, drafts]
    # What the step verifies, on the host: its first position per sequence and its drafts. A
    # step launched ahead learns them when the step before it is read (expect()).
    start_positions: list[int]
    draft_token_ids: list[list[int]]
    accept_limits: list[int | None]
    sampled: PaddedSampling | None  # the sampled rows' parameters and keys (None: greedy only)
    extras: PaddedStepExtras  # logits controls and logprobs (the latter in the copy after the drafts)
    drafter_rows: "DrafterRows | None" = None  # the step's target rows, for a hybrid's model drafter

    @property
    def num_drafts(self) -> int:
        """m: the drafts per sequence this step makes."""
        return self.drafts.shape[1]

    def launch_next(self, num_next_drafts: int | None = None) -> "LaunchedVerify | None":
        """The step after this one (num_next_drafts: the scheduler's choice of drafts for it,
        None: all), queued when can_follow() allows."""
        if not self.kind.can_follow(self, num_next_drafts):
            return None
        return self.kind.launch_after(self, num_next_drafts)

    def read(self, following: "LaunchedVerify | None") -> list[SequenceResult]:
        """This step's results; the step queued after it learns what it verifies from them."""
        results = self.results()
        if following is not None:
            following.expect(self, results)
        return results

    def results(self) -> list[SequenceResult]:
        n, m = len(self.seqs), self.num_drafts
        host = self.copy.read()
        results = [
            SequenceResult(
                new_token_ids=drafts[: host[i]] + [host[n + i]],
                num_accepted=host[i],
                num_drafts=len(drafts) if limit is None else min(len(drafts), limit),
                next_drafts=host[2 * n + i * m : 2 * n + (i + 1) * m],
            )
            for i, (drafts, limit) in enumerate(zip(self.draft_token_ids, self.accept_limits))
        ]
        self.extras.read(self.key[1], host[2 * n + n * m :], results)  # logprobs, grammars
        return results

    def expect(self, previous: "LaunchedVerify", previous_results: list) -> None:
        """Fill in what this step (launched after `previous`) verifies, from previous's results."""
        self.start_positions = [
            p + r.num_accepted + 1 for p, r in zip(previous.start_positions, previous_results)
        ]
        q = self.key[1]
        self.draft_token_ids = [r.next_drafts[: q - 1] for r in previous_results]

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        """Whether the scheduler's decision is this step: its sequences in order, each verifying
        the expected drafts from the expected position, with no cap on acceptance."""
        if len(scheduled) != len(self.seqs):
            return False
        q = self.key[1]
        for item, seq, start, drafts in zip(scheduled, self.seqs, self.start_positions, self.draft_token_ids):
            if (
                item.seq is not seq
                or seq.num_computed_tokens != start
                or item.num_new_tokens != q
                or not item.samples
                or item.accept_limit is not None
                or item.draft_token_ids != drafts
            ):
                return False
        return True
