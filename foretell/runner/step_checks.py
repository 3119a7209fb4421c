"""Per-sequence checks of a scheduled step, run before anything of it reaches the device.

A bad sequence fails alone (engine/errors.SequenceError names it) instead of breaking the whole
batch's forward: every row must sit below max_model_len (the rotary tables and block tables end
there), and every draft must be a token id of the target.
"""

from __future__ import annotations

from foretell.engine.errors import SequenceError
from foretell.engine.scheduler import SchedulerOutput


def check_step(sched: SchedulerOutput, max_model_len: int, vocab_size: int) -> None:
    """Raises SequenceError for the first scheduled sequence that would run past max_model_len
    or carries a draft token outside [0, vocab_size)."""
    for item in sched.scheduled:
        seq = item.seq
        end = seq.num_computed_tokens + item.num_new_tokens
        if end > max_model_len:
            raise SequenceError(
                seq.seq_id, f"sequence {seq.request_id!r} would run positions up to {end - 1}, past "
                            f"max_model_len {max_model_len}"
            )
        drafts = item.draft_token_ids
        if drafts and not 0 <= min(drafts) <= max(drafts) < vocab_size:
            raise SequenceError(
                seq.seq_id, f"sequence {seq.request_id!r} got draft tokens outside the target's "
                            f"vocabulary [0, {vocab_size}): {drafts}"
            )
