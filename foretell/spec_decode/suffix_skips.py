"""The suffix drafter's skipped calls: after a call whose learned bar is k or more (no draft of at
most k tokens can pay for its step), the next calls of the same batch look nothing up and only
stamp the gate's clock (StepCostBar.stamp_same_batch); the bar is not worked out for them. A bar
falling below k meanwhile is seen up to a run late: drafts change speed only, never tokens.

The same follows a step whose batch's drafts were all dropped because together they could not pay
the batch's verify (SuffixProposer._draft_batch): each of its sequences' lookups is host time.
Runs grow: the first is FIRST_SKIPPED_RUN calls, and each run started before a step drafted again
is twice as long, up to MAX_SKIPPED_RUN; a step that drafts starts over at the first length. A
workload whose bar stays at k or more (a
small target on a fast GPU with k = 3: a plain step is host work queued ahead, a verify waits for
its results) then works the bar out a handful of times per request, not every 16 steps.

Through the runner's host step (SuffixProposer.propose_step) a skipped call also does nothing per
sequence: the batch is dormant. Its sequences' new tokens are not stored call by call; each
sequence's state catches up from the sequence's token list (the engine's, appended in place) when
the run ends, the batch changes, or the sequence is forgotten (wake, wake_one): the tokens go to
the state's pending list, where a call without a lookup would have put them one by one, so the
states and drafts are those of storing them at each call.
"""

from __future__ import annotations

from foretell.spec_decode.suffix_state import SequenceState

#: Calls skipped after the first call whose learned bar is k or more.
FIRST_SKIPPED_RUN = 16
#: The longest run of skipped calls (runs double while the bar keeps barring).
MAX_SKIPPED_RUN = 256


class SkippedCalls:
    """Calls left to skip, the next run's length, and the dormant batch (module docstring)."""

    def __init__(self):
        self.left = 0  # calls of the batch still to skip
        self.next_run = FIRST_SKIPPED_RUN
        self.dormant_ids: tuple | None = None  # the dormant batch's sequence ids (None: awake)
        self.histories: dict[int, list[int]] = {}  # its sequences' token lists, by sequence id

    def start_run(self) -> None:
        """A call barred by the learned bar (or whose batch could not pay): skip the batch's next
        calls, a run twice the last."""
        self.left = self.next_run
        self.next_run = min(2 * self.next_run, MAX_SKIPPED_RUN)

    def stop(self) -> None:
        """A step that drafts: nothing skipped, the next run short."""
        self.left = 0
        self.next_run = FIRST_SKIPPED_RUN

    def sleep(self, items) -> None:
        """The batch of this call (items: scheduled sequences, .seq.seq_id and .seq.token_ids, the
        list the engine extends) dormant for the calls left: their tokens are caught up later."""
        self.dormant_ids = tuple([item.seq.seq_id for item in items])
        self.histories = {item.seq.seq_id: item.seq.token_ids for item in items}

    def skips(self, items) -> bool:
        """Whether this call (its scheduled sequences, all sampling) is the dormant batch's: the same
        sequences in the same order; the caller then stamps the clock and counts it."""
        ids = self.dormant_ids
        if ids is None or len(items) != len(ids):
            return False
        for item, seq_id in zip(items, ids):
            if item.seq.seq_id != seq_id or not item.samples:
                return False
        return True

    def wake(self, states: dict[int, SequenceState]) -> None:
        """Every dormant sequence's state caught up with its token list; the batch awake."""
        for seq_id, history in self.histories.items():
            catch_up(states.get(seq_id), history)
        self.dormant_ids, self.histories = None, {}

    def wake_one(self, seq_id: int, state: SequenceState | None) -> None:
        """One sequence's state caught up (it is forgotten: its response goes to the cache whole)."""
        history = self.histories.pop(seq_id, None)
        if history is not None:
            catch_up(state, history)


def catch_up(state: SequenceState | None, history: list[int]) -> None:
    """The tokens of history after those the state has seen, into its pending list (unindexed,
    as a call without a lookup stores them). Nothing when history does not continue them."""
    if state is None:
        return
    new = state.new_tokens(history)
    if new:
        if state.pending:
            state.pending += new
        else:
            state.pending = new
