"""Continuous batching: which sequences run this step, and how many tokens each.

Per step, under a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
running sequences first (1 decode token, or 1 + k verify tokens when they carry drafts, or the
next prefill chunk), then waiting ones are admitted (prefix-cache hit first, then a prefill chunk).
A sequence that will sample this step also reserves `num_lookahead_tokens` slots, where the
drafter writes its KV for the next k drafts. When blocks run out, the most recently admitted
running sequence is preempted by recompute: its blocks are freed and it goes back to the front of
the queue, to be prefilled again (prompt and output so far) and continue exactly where it was.

Under adaptive speculation (spec_decode/adaptive.py) a DraftLength policy chooses, each step,
how many drafts the proposer makes for the next one (SchedulerOutput.num_next_drafts) from the
batch it expects (running sequences, and the waiting ones unless the KV cache keeps them out, up
to max_num_seqs); the next step verifies at most that many (draft_limit), and postprocess()
reports every verify's drafted and accepted counts back to it.

postprocess() applies what the runner produced: accepted drafts plus one new token per sampling
sequence, stop conditions, and the commit of newly full blocks to the prefix cache. Rejected draft
slots need no undo: num_computed_tokens simply does not cover them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from foretell.config import SchedulerConfig
from foretell.engine.block_manager import BlockManager
from foretell.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # rows this sequence feeds the target this step (drafts included)
    draft_token_ids: list[int]  # the drafts among those rows (the last len() of them)
    samples: bool  # whether the step reaches the sequence's end and samples a token
    # At most this many drafts may be accepted (None: all): set instead of dropping drafts near
    # max_tokens when the runner keeps every verify at k + 1 rows (its CUDA graphs' shape).
    accept_limit: int | None = None

    @property
    def num_usable_drafts(self) -> int:  # what the acceptance statistics count as drafted
        n = len(self.draft_token_ids)
        return n if self.accept_limit is None else min(n, self.accept_limit)

    @property
    def input_token_ids(self) -> list[int]:
        start = self.seq.num_computed_tokens
        real = self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[start : start + real] + self.draft_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Drafts per sampling sequence the proposer makes for the next step (None: its k); set under
    # adaptive speculation.
    num_next_drafts: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class DraftLength(Protocol):
    """How many drafts to make for the next step (spec_decode/adaptive.py)."""

    def choose(self, batch_size: int) -> int: ...

    def observe(self, num_drafted: int, num_accepted: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        keep_draft_rows: bool = False,
    ):
        self.config = config
        self.keep_draft_rows = keep_draft_rows
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.draft_length: DraftLength | None = None  # adaptive speculation's policy
        self.draft_limit: int | None = None  # most drafts a verify takes (the last choice)

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {seq.num_tokens} tokens, but max_model_len is {self.max_model_len}: "
                f"shorten the prompt or raise --max-model-len"
            )
        needed = -(-(seq.num_tokens + 1 + self.num_lookahead_tokens) // self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens needs {needed} KV blocks, but the cache has "
                f"only {self.block_manager.num_blocks}: give the KV cache more memory"
            )
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.spec_token_ids = []
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)

    # ---- scheduling ---------------------------------------------------------------------
    def _plan(self, seq: Sequence, budget: int) -> tuple[int, list[int], int | None]:
        """How many rows the sequence runs within the budget, which of them are drafts, and how
        many of those may be accepted (None: all)."""
        remaining = len(seq.token_ids) - seq.num_computed_tokens  # seq.num_uncomputed_tokens
        if remaining > 1:
            if not self.config.enable_chunked_prefill and remaining > budget:
                return 0, [], None
            return min(remaining, budget), [], None
        if not seq.spec_token_ids:  # a plain decode step: one row, nothing to cap
            return 1, [], None
        room = min(budget - 1, self.max_model_len - seq.num_tokens)
        if self.draft_limit is not None:
            room = min(room, self.draft_limit)
        drafts = seq.spec_token_ids[: max(0, room)]
        params = seq.sampling_params
        if params.max_tokens is None:
            return 1 + len(drafts), drafts, None
        # A verify emits up to accepted + 1 tokens: none may pass max_tokens.
        usable = max(0, params.max_tokens - seq.num_output_tokens - 1)
        if usable >= len(drafts):
            return 1 + len(drafts), drafts, None
        if self.keep_draft_rows and params.greedy:
            # Keep the rows (the verify stays on its graph) and cap what may be accepted (logprobs
            # follow the emitted rows, capped). Only greedy requests: a capped sampled request
            # would draw other tokens than an eager engine's for the same seed.
            return 1 + len(drafts), drafts, usable
        return 1 + usable, drafts[:usable], None

    def _reserve(self, seq: Sequence, num_new: int, samples: bool) -> bool:
        lookahead = self.num_lookahead_tokens if samples else 0
        return self.block_manager.allocate(seq, seq.num_computed_tokens + num_new + lookahead)

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new, drafts, limit = self._plan(seq, budget)
            if num_new == 0:
                i += 1
                continue
            samples = seq.num_computed_tokens + num_new - len(drafts) >= len(seq.token_ids)
            while not self._reserve(seq, num_new, samples):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:  # preempted itself: nothing else fits
                break
            out.scheduled.append(ScheduledSequence(seq, num_new, drafts, samples, limit))
            budget -= num_new
            i += 1

        out_of_blocks = bool(out.preempted)  # waiting sequences cannot join for now (adaptive's batch)
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            self.block_manager.admit(seq)
            num_new, drafts, limit = self._plan(seq, budget)
            samples = seq.num_computed_tokens + num_new >= seq.num_tokens
            if num_new == 0 or not self._reserve(seq, num_new, samples):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                out_of_blocks = True
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new, drafts, samples, limit))
            budget -= num_new
        if self.draft_length is not None:
            # Chosen for the batch the coming steps run: every running sequence (those still in
            # prefill included) and, unless the KV cache is what keeps them out, the waiting ones
            # that fit beside them; not the few that sample now. While a batch fills, a choice for
            # the first sequences to finish their prompts drafted long, and their drafts padded
            # the verify of the whole batch to that length.
            any_samples = any(item.samples for item in out.scheduled)  # (stops at the first: this runs every step)
            joining = 0 if out_of_blocks else len(self.waiting)
            expected = min(len(self.running) + joining, self.config.max_num_seqs)
            next_batch = expected if any_samples else 0
            out.num_next_drafts = self.draft_limit = self.draft_length.choose(next_batch)
        return out

    # ---- applying results ------------------------------------------------------------------
    def postprocess(
        self, item: ScheduledSequence, new_token_ids: list[int], num_accepted: int
    ) -> list[int]:
        """Advance one sequence by this step's result; returns the tokens actually appended.

        new_token_ids = the accepted drafts followed by one token from the target (empty for a
        prefill chunk that does not reach the end). Stops (EOS, stop ids, max_tokens, max length)
        may cut the list short; stop strings are checked by the engine after detokenization.
        """
        seq = item.seq
        if seq.status is SequenceStatus.FINISHED:
            return []
        seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + num_accepted
        if self.draft_length is not None and item.draft_token_ids:
            self.draft_length.observe(item.num_usable_drafts, num_accepted)
        params = seq.sampling_params
        token_ids = seq.token_ids
        # The stop checks with what is constant over the loop read once (a step of one
        # decode token is the common case; this runs for every sequence of every step).
        eos_ids = () if params.ignore_eos else seq.eos_token_ids
        stop_ids = params.stop_token_ids
        max_tokens = params.max_tokens
        max_len = self.max_model_len
        num_prompt = len(seq.prompt_token_ids)
        for i, token in enumerate(new_token_ids):
            token_ids.append(token)
            if token in eos_ids or token in stop_ids:
                seq.stop_reason = token
                self.finish(seq, "stop")
            elif (max_tokens is not None and len(token_ids) - num_prompt >= max_tokens) or len(token_ids) >= max_len:
                seq.stop_reason = None
                self.finish(seq, "length")
            else:
                continue
            return new_token_ids[: i + 1]
        seq.spec_token_ids = []
        if max_tokens is not None and len(token_ids) - num_prompt >= max_tokens:
            self.finish(seq, "length")
        else:
            self.block_manager.commit(seq)
        return list(new_token_ids)
