"""A batch of prompt chunks beside verifies: one forward, the verifies finished by the padded step.

The scheduler mixes a new request's prompt chunk with the running sequences' verifies (chunked
prefill). The padded verify step (graphed_verify.py) takes only verify-shaped sequences: one row
plus the drafts, sampling. Rather than verify every sequence of such a batch on the host step,
the runner splits the decision: the verify-shaped sequences are planned as a padded step (their
drafts padded to its q - 1), then one eager target forward runs over those padded rows and the
other sequences' rows (prompt chunks, chunks that do not sample) together (forward_split). The
verify rows' outputs go into the padded step's buffers (CudaGraphRunner.load), where verification
and the draft loop read them as after a replay; the prompt chunks' rows go to the host step,
which samples their last rows and catches the drafter up over them, and verifies nothing. So
drafts are verified in one place, and the mixed batch costs one pass over the weights, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.runner.input_batch import build_input_batch, rows_within

if TYPE_CHECKING:
    from foretell.runner.graphed_verify import VerifyPlan


def verify_shaped(item: ScheduledSequence) -> bool:
    """Whether a scheduled sequence feeds one row plus its drafts and samples (a verify, or a
    decode with no drafts): the rows the padded step takes."""
    return item.samples and item.num_new_tokens == 1 + len(item.draft_token_ids)


@dataclass
class SplitBatch:
    """One scheduler decision as two: `verify` (the verify-shaped sequences) and `prefill` (the
    rest), with each part's positions in the original list."""

    verify: SchedulerOutput
    verify_index: list[int]
    prefill: SchedulerOutput
    prefill_index: list[int]

    @classmethod
    def of(cls, sched: SchedulerOutput) -> "SplitBatch | None":
        """The decision split, None when it holds no verify-shaped sequence or nothing else."""
        verify_index = [i for i, item in enumerate(sched.scheduled) if verify_shaped(item)]
        if not verify_index or len(verify_index) == len(sched.scheduled):
            return None
        taken = set(verify_index)
        prefill_index = [i for i in range(len(sched.scheduled)) if i not in taken]

        def part(index: list[int]) -> SchedulerOutput:
            return SchedulerOutput([sched.scheduled[i] for i in index], num_next_drafts=sched.num_next_drafts)

        return cls(part(verify_index), verify_index, part(prefill_index), prefill_index)

    def merge(self, verify_results: list, prefill_results: list) -> list:
        """The two parts' per-sequence results in the original decision's order."""
        results = [None] * (len(self.verify_index) + len(self.prefill_index))
        for i, result in zip(self.verify_index, verify_results):
            results[i] = result
        for i, result in zip(self.prefill_index, prefill_results):
            results[i] = result
        return results


class ForwardRows:
    """A part of one forward's outputs: hidden [rows, hidden], aux (each [rows, hidden]) and the
    logits of its sampling rows [sampling rows, vocab] float32. With the vocabulary split over
    tensor-parallel ranks the logits are gathered only when read (`logits_of`), and `greedy`
    [sampling rows] int64 holds the rows' greedy tokens from each rank's row maxima."""

    def __init__(self, hidden: torch.Tensor, aux: list[torch.Tensor],
                 logits: "torch.Tensor | Callable[[], torch.Tensor]", greedy: torch.Tensor | None = None):
        self.hidden = hidden
        self.aux = aux
        self.logits_of = logits  # the tensor, or the function that gathers it
        self.greedy = greedy

    @property
    def logits(self) -> torch.Tensor:  # [sampling rows, vocab] float32
        if callable(self.logits_of):
            self.logits_of = self.logits_of()
        return self.logits_of


def forward_split(model, plan: "VerifyPlan", prefill: SchedulerOutput, block_size: int, max_model_len: int,
                  device: torch.device) -> tuple[ForwardRows, ForwardRows]:
    """One eager target forward over the planned verify rows (each sequence's q rows, first; padded
    rows past max_model_len placed as the plan's are) and the prefill part's rows (after them):
    (the verify rows' outputs, every row with logits; the prefill part's, its sampling rows' logits
    in its own batch's order)."""
    batch = rows_within(build_input_batch(plan.items + prefill.scheduled, block_size, device), max_model_len)
    hidden, aux = model(batch.input_ids, batch.positions, batch.attn_metadata)  # [rows, hidden]
    sampling = hidden[batch.logits_rows]  # [verify rows + prefill sampling rows, hidden]
    rows = plan.batch.num_tokens  # the verify rows, all of them logits rows, in order
    verify, prefill_part = (hidden[:rows], [a[:rows] for a in aux]), (hidden[rows:], [a[rows:] for a in aux])
    if getattr(model, "splits_vocabulary", False):  # each part's logits gathered when read; greedy tokens gather none
        greedy = model.compute_greedy_tokens(sampling)  # [sampling rows] int64
        return (ForwardRows(*verify, lambda: model.compute_logits(sampling[:rows]), greedy[:rows]),
                ForwardRows(*prefill_part, lambda: model.compute_logits(sampling[rows:]), greedy[rows:]))
    logits = model.compute_logits(sampling)  # [verify rows + prefill sampling rows, vocab]
    return ForwardRows(*verify, logits[:rows]), ForwardRows(*prefill_part, logits[rows:])
