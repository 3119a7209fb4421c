"""Failures inside an engine step that belong to one sequence, so the engine can fail that
request alone (finish_reason "error", RequestOutput.error) and let the rest of the batch go on.

Whatever runs a step (the runner, a proposer, the engine's own per-sequence processing) raises
SequenceError with the sequence's id when it can tell whose input is at fault; anything else
raised inside the step fails every request of that step (Engine.step).
"""

from __future__ import annotations


class SequenceError(RuntimeError):
    """A failure of one sequence inside a step; the message says what went wrong, for the user."""

    def __init__(self, seq_id: int, message: str):
        super().__init__(message)
        self.seq_id = seq_id

    def __reduce__(self):  # pickles whole (a tensor-parallel worker sends it to the engine's process)
        return type(self), (self.seq_id, str(self)), self.__dict__
