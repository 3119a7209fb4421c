"""One generation stream: its tokens, how many of them have their KV in the cache, its blocks,
and the draft tokens waiting to be verified. A request with n > 1 owns n sequences.

No torch here: the scheduler and block manager work on plain Python state.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from foretell.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n alternatives at this position


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV entries in the cache are final. Everything before it was verified; the
    # slots after it may hold rejected drafts and are simply overwritten later (the rollback).
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the last (re)admission
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    # prompt_logprobs[j]: log-prob of prompt token j + 1 given the tokens before it.
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the target still has to run before it can sample (>= 1 while running)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the cache; the next admission prefills everything."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids = []
        self.spec_token_ids = []
        self.num_preemptions += 1
