"""A host drafter's greedy verify step, verified on the host from the target's greedy tokens.

The padded verify step (graphed_verify.GraphedVerify) verifies on the device so that the step
after it can be queued before the host reads anything: the draft loop and the next step's inputs
read the accepted counts there. A host drafter (n-gram, suffix: host_drafts.HostDraftSlots) has
neither: its drafts come from the host lists after the read, so the step after a drafting step is
always launched from host inputs, and nothing on the device ever reads the verification's outputs.
For such a step whose rows are all greedy, with no logits controls, logprobs or grammar (the
verification reads the target's greedy tokens as the graph left them) and an exact verifier,
GraphedVerify.launch returns a HostVerifiedStep instead: the graph's greedy tokens of the step's
rows ([n * q], one contiguous view of the graph's output) are copied to the host on the graph's
stream, and acceptance is counted on the host (greedy_accept_on_host), as accept_drafts counts it
on the device: each sequence accepts its drafts up to the first that differs from the target's
token at its row, capped at its real drafts (padded rows are never accepted) and its accept limit;
its next token is the target's at the row after them.

What this leaves out of a drafting step, per step: the caps' upload, the verification kernel's
launch, the views over the graph's outputs and the draft loop's buffers, and the read-back's
concatenation on the side stream (with its stream switch and event waits): one copy of the
greedy tokens and one event instead. The host's count is a loop over at most the accepted drafts
plus one of each sequence.

Never queued ahead and never followed: launch_next returns None (a host drafter's next step is
launched from host inputs anyway, its drafts being the host's), matches() is never asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from foretell.engine.scheduler import ScheduledSequence
from foretell.engine.sequence import Sequence
from foretell.runner.sequence_result import SequenceResult
from foretell.runner.step_pipeline import HostCopy


def greedy_accept_on_host(tokens: list[int], q: int, draft_ids: list[list[int]],
                          limits: list[int | None]) -> list[SequenceResult]:
    """Greedy verification of a padded step from the target's greedy token at each row: tokens
    [n * q] (sequence i's rows at i * q .. i * q + q - 1), each sequence's real drafts (at most
    q - 1; the rest of its rows padding) and accept limit (None: none). Returns each sequence's
    result: its accepted drafts and the target's token after them, the count, and the drafts it
    verified (as many as it may accept)."""
    if len(tokens) != q * len(draft_ids) or len(limits) != len(draft_ids):
        raise ValueError(f"{len(tokens)} tokens for {len(draft_ids)} sequences of {q} rows "
                         f"({len(limits)} accept limits)")
    results = []
    row = 0
    for drafts, limit in zip(draft_ids, limits):
        if len(drafts) >= q:
            raise ValueError(f"{len(drafts)} drafts do not fit a step of {q} rows per sequence")
        cap = len(drafts) if limit is None else min(len(drafts), limit)
        accepted = 0
        while accepted < cap and tokens[row + accepted] == drafts[accepted]:
            accepted += 1
        results.append(SequenceResult(new_token_ids=drafts[:accepted] + [tokens[row + accepted]],
                                      num_accepted=accepted, num_drafts=cap))
        row += q
    return results


@dataclass
class HostVerifiedStep:
    """A padded verify step on its way whose verification the host does at read (a QueuedStep of
    runner/step_pipeline.py that nothing follows)."""

    seqs: list[Sequence]
    key: tuple[int, int]  # (batch bucket, q: rows per sequence) of the graph it ran
    copy: HostCopy  # of the target's greedy tokens [len(seqs) * q]
    draft_token_ids: list[list[int]]  # each sequence's real drafts
    accept_limits: list[int | None]

    def matches(self, scheduled: list[ScheduledSequence], block_size: int) -> bool:
        return False  # never queued ahead

    def launch_next(self, num_next_drafts: int | None = None) -> None:
        return None  # the next step's drafts are the host's: launched from host inputs

    def read(self, following: None) -> list[SequenceResult]:
        return greedy_accept_on_host(self.copy.read(), self.key[1], self.draft_token_ids, self.accept_limits)
