"""The per-step plan the front process sends to tensor-parallel ranks, and the per-sequence state
the ranks keep so that the plan stays small.

Without it every step pickled whole Sequence objects (every token so far, the prompt, the sampling
parameters, the block table) to every rank: bytes that grow with each sequence's length. Instead:

  front (ParallelRunner)                         each rank (RankRunner)
  PlanEncoder.encode(sched) -> StepPlan  ----->  SequenceMirrors.apply(plan) -> SchedulerOutput
                                                 over mirror Sequences it keeps per seq_id
  PlanEncoder.forget(seq_id)             ----->  SequenceMirrors.forget(seq_id)   (same order)

A sequence's first plan carries what never changes (NewSequence: request id, sample index, prompt,
sampling parameters, EOS ids); every plan carries per scheduled sequence only what changed since
the last one it was in (PlannedSequence: tokens appended, blocks appended, or the whole table after
a re-admission) and the step's own fields (rows, drafts, whether it samples). A decode step's plan
is therefore the same size whatever the sequence's length. The front's Sequence stays the truth:
the mirror applies what the front says (including tokens the rank itself produced last step) and
checks its length against the plan's num_tokens, so a mirror that fell out of step fails loudly.

The encoder relies on two facts of the engine's core: a sequence's tokens only grow while it runs
(a stop string trims them only as it finishes), and its block list only grows (block_manager
extends it in place; an admission or a free assigns a new list). Either way the start index each
delta applies from is in the plan, so a shorter list is resent from where it changed.
"""

from __future__ import annotations

from typing import NamedTuple

from foretell.engine.scheduler import ScheduledSequence, SchedulerOutput
from foretell.engine.sequence import Sequence, SequenceStatus
from foretell.sampling_params import SamplingParams


class NewSequence(NamedTuple):
    """What a rank needs once per sequence (until it is forgotten)."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # one object for a request's n samples: pickled once
    eos_token_ids: frozenset[int]


class PlannedSequence(NamedTuple):
    """One scheduled sequence's change since its last plan, and this step's work for it."""

    seq_id: int
    tokens_from: int  # token_ids[tokens_from:] are replaced by new_token_ids
    new_token_ids: list[int]
    num_tokens: int  # the length after that (a consistency check)
    num_computed_tokens: int
    blocks_from: int  # block_ids[blocks_from:] are replaced by new_block_ids
    new_block_ids: list[int]
    num_new_tokens: int
    draft_token_ids: list[int]
    samples: bool
    accept_limit: int | None
    num_prompt_logprobs: int | None  # len(seq.prompt_logprobs), only for requests that ask


class StepPlan(NamedTuple):
    new: list[NewSequence]
    scheduled: list[PlannedSequence]
    num_next_drafts: int | None = None  # SchedulerOutput's (adaptive speculation's choice)


class _Sent:
    """What the ranks hold of one sequence, as the encoder last sent it."""

    __slots__ = ("num_tokens", "blocks", "num_blocks")

    def __init__(self) -> None:
        self.num_tokens = 0
        self.blocks: list[int] | None = None  # the front's list object itself (grows in place)
        self.num_blocks = 0


class PlanEncoder:
    """The front process's side: turns each SchedulerOutput into a StepPlan."""

    def __init__(self) -> None:
        self.sent: dict[int, _Sent] = {}

    def encode(self, sched: SchedulerOutput) -> StepPlan:
        new: list[NewSequence] = []
        scheduled: list[PlannedSequence] = []
        for item in sched.scheduled:
            seq = item.seq
            sent = self.sent.get(seq.seq_id)
            if sent is None:
                sent = self.sent[seq.seq_id] = _Sent()
                new.append(NewSequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids,
                                       seq.sampling_params, seq.eos_token_ids))
            tokens = seq.token_ids
            tokens_from = min(sent.num_tokens, len(tokens))
            blocks = seq.block_ids
            blocks_from = sent.num_blocks if blocks is sent.blocks and len(blocks) >= sent.num_blocks else 0
            wants_prompt_logprobs = seq.sampling_params.prompt_logprobs is not None
            scheduled.append(PlannedSequence(
                seq.seq_id, tokens_from, tokens[tokens_from:], len(tokens), seq.num_computed_tokens,
                blocks_from, blocks[blocks_from:], item.num_new_tokens, item.draft_token_ids, item.samples,
                item.accept_limit, len(seq.prompt_logprobs) if wants_prompt_logprobs else None,
            ))
            sent.num_tokens, sent.blocks, sent.num_blocks = len(tokens), blocks, len(blocks)
        return StepPlan(new, scheduled, sched.num_next_drafts)

    def forget(self, seq_id: int) -> None:
        self.sent.pop(seq_id, None)

    def forget_all(self) -> None:
        self.sent.clear()


class SequenceMirrors:
    """A rank's side: one mirror Sequence per sequence the front has planned and not forgotten."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def apply(self, plan: StepPlan) -> SchedulerOutput:
        for new in plan.new:
            seq = Sequence(new.seq_id, new.request_id, new.index, new.prompt_token_ids, new.sampling_params,
                           new.eos_token_ids)
            seq.status = SequenceStatus.RUNNING
            self.seqs[new.seq_id] = seq
        out = SchedulerOutput(num_next_drafts=plan.num_next_drafts)
        for planned in plan.scheduled:
            seq = self.seqs.get(planned.seq_id)
            if seq is None:
                raise RuntimeError(
                    f"step plan names sequence {planned.seq_id}, which this rank does not hold (forgotten, "
                    f"or never sent): the front process and the rank are out of step"
                )
            del seq.token_ids[planned.tokens_from:]
            seq.token_ids.extend(planned.new_token_ids)
            if len(seq.token_ids) != planned.num_tokens:
                raise RuntimeError(
                    f"sequence {planned.seq_id} holds {len(seq.token_ids)} tokens on this rank, the front "
                    f"process {planned.num_tokens}: the front process and the rank are out of step"
                )
            seq.num_computed_tokens = planned.num_computed_tokens
            del seq.block_ids[planned.blocks_from:]
            seq.block_ids.extend(planned.new_block_ids)
            if planned.num_prompt_logprobs is not None:
                # Only the count is read on a rank (which prompt positions still need theirs).
                recorded = seq.prompt_logprobs
                del recorded[planned.num_prompt_logprobs:]
                recorded.extend([None] * (planned.num_prompt_logprobs - len(recorded)))
            out.scheduled.append(ScheduledSequence(seq, planned.num_new_tokens, planned.draft_token_ids,
                                                   planned.samples, planned.accept_limit))
        return out

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def forget_all(self) -> None:
        self.seqs.clear()
