"""What one step produced for one scheduled sequence, handed from the runner to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from foretell.engine.sequence import Logprob


@dataclass
class SequenceResult:
    new_token_ids: list[int] = field(default_factory=list)  # accepted drafts + one target token
    num_accepted: int = 0
    num_drafts: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    next_drafts: list[int] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # prompt positions this step
