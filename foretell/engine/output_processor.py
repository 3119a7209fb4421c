"""Output processing: what a step's result does to a request, and the RequestOutput made of it.

For one sequence: the scheduler appends the accepted drafts and the target's token (EOS, stop ids
and max_tokens cut them there), the detokenizer grows the text and applies stop strings (cutting
tokens a verify step accepted past one), logprobs follow the tokens kept, and the metrics count
them; when a request asks, each kept token's origin (engine/token_origins.py: accepted draft, the
target's correction, bonus, plain target token) is recorded beside it, cut by the same stops. The
engine drives the step and the runner; this module holds the per-request bookkeeping. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from foretell.engine.metrics import EngineMetrics
from foretell.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from foretell.engine.scheduler import ScheduledSequence, Scheduler
from foretell.engine.sequence import Sequence, SequenceStatus
from foretell.engine.token_origins import TokenOrigin, step_origins
from foretell.sampling_params import SamplingParams

if TYPE_CHECKING:
    from foretell.engine.sequence import Logprob
    from foretell.tokenizer import IncrementalDetokenizer


class StepResult(Protocol):
    """What the runner returns for one sequence of a step (runner/sequence_result.py)."""

    new_token_ids: list[int]  # accepted drafts, then the target's token
    num_drafts: int
    num_accepted: int
    logprobs: list[Logprob]
    prompt_logprobs: list[Logprob]


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    aborted: bool = False
    outputs_sent: bool = field(default=False)
    error: str | None = None  # why the request failed inside a step (finish_reason "error")
    # Per sequence, the origin of each output token (None unless params.return_token_origins).
    token_origins: list[list[TokenOrigin]] | None = None

    def __post_init__(self) -> None:
        if self.params.return_token_origins and self.token_origins is None:
            self.token_origins = [[] for _ in self.seqs]

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all() over a generator: asked every step
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True


def apply_result(
    item: ScheduledSequence,
    result: StepResult,
    request: Request,
    now: float,
    scheduler: Scheduler,
    metrics: EngineMetrics,
) -> list[int]:
    """One sequence's share of a step: tokens, stops, logprobs, counters. Returns the tokens
    kept (empty for a prefill chunk that does not reach the end, or a finished sequence)."""
    seq = item.seq
    if metrics.spec is not None and result.num_drafts:  # (a step without drafts records nothing)
        metrics.spec.record(result.num_drafts, result.num_accepted)
    if result.prompt_logprobs:
        seq.prompt_logprobs.extend(result.prompt_logprobs)
    appended = scheduler.postprocess(item, result.new_token_ids, result.num_accepted)
    if not appended:
        return []
    request_metrics = request.metrics
    if request_metrics.first_token_time is None:
        request_metrics.first_token_time = now
        request_metrics.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
    detok = request.detokenizers[seq.index]
    if detok is not None:
        appended = apply_stop_strings(seq, detok, appended, scheduler)
    metrics.generation_tokens_total += len(appended)
    if request.token_origins is not None:
        record_origins(request.token_origins[seq.index], item, result, len(appended))
    if result.logprobs:  # only requests that asked for logprobs carry any
        logprobs = result.logprobs[: len(appended)]
        seq.logprobs.extend(logprobs)
        seq.cumulative_logprob += sum(lp.logprob for lp in logprobs)
    return appended


def record_origins(
    origins: list[TokenOrigin], item: ScheduledSequence, result: StepResult, num_kept: int
) -> None:
    """Append the origins of the first num_kept of this step's tokens (stops cut the rest)."""
    step = origins[-1].step + 1 if origins else 0
    new = step_origins(item.draft_token_ids, result.num_drafts, result.new_token_ids,
                       result.num_accepted, step)
    origins.extend(new[:num_kept])


def apply_stop_strings(
    seq: Sequence, detok: IncrementalDetokenizer, appended: list[int], scheduler: Scheduler
) -> list[int]:
    """Detokenize this step's tokens; on a stop string, drop the tokens after the one that
    completed it (a verify step may have accepted several past it) and finish the sequence.
    Returns the tokens kept."""
    stop, taken = detok.add(appended)
    if stop is None:
        return appended
    if taken < len(appended):
        del seq.token_ids[len(seq.token_ids) - (len(appended) - taken) :]
    seq.stop_reason = stop
    if seq.is_finished:  # an EOS / stop id / max_tokens after the stop string: the string won
        seq.finish_reason = "stop"
    else:
        scheduler.finish(seq, "stop")
    return appended[:taken]


def make_output(request: Request) -> RequestOutput:
    """The request as the caller sees it now: text, tokens, finish reasons, logprobs."""
    want_logprobs = request.params.logprobs is not None
    completions = [
        CompletionOutput(
            index=seq.index,
            text=detok.text if detok is not None else "",
            token_ids=seq.output_token_ids,  # a new list (a slice): the caller may keep it
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if want_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
            token_origins=(
                list(request.token_origins[seq.index]) if request.token_origins is not None else None
            ),
        )
        for seq, detok in zip(request.seqs, request.detokenizers)
    ]
    prompt_logprobs = None
    if request.params.prompt_logprobs is not None:
        prompt_logprobs = [None] + list(request.seqs[0].prompt_logprobs)
    return RequestOutput(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        completions,
        finished=request.finished,
        metrics=request.metrics,
        prompt_logprobs=prompt_logprobs,
        error=request.error,
    )
