"""What generate() returns and the server streams: RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from foretell.engine.sequence import Logprob
from foretell.engine.token_origins import TokenOrigin


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None
    # Per token, how speculation produced it (SamplingParams.return_token_origins; else None).
    token_origins: list[TokenOrigin] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Per prompt token (None for the first) when SamplingParams.prompt_logprobs is set.
    prompt_logprobs: list[Logprob | None] | None = None
    metrics: RequestMetrics | None = None
    # Set when the request failed inside a step (its completions end with finish_reason
    # "error"): what went wrong, for the user. Other requests of that step go on.
    error: str | None = None
