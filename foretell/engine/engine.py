"""The engine: requests in, one step at a time (schedule -> execute -> postprocess), outputs out.

Synchronous and single-threaded; the server's async front drives it from one loop. The steps
run on a RunnerHandle (runner/handle.py): a ModelRunner on one device, or with
tensor_parallel_size > 1 a ParallelRunner driving one worker process per rank. A lost worker
(dead, or out of step with the others) ends the engine: step() raises, now and on every later call.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time

from foretell.config import EngineConfig
from foretell.engine.block_manager import BlockManager
from foretell.engine.errors import SequenceError
from foretell.engine.metrics import EngineMetrics
from foretell.engine import output_processor
from foretell.engine.output_processor import Request
from foretell.engine.outputs import RequestMetrics, RequestOutput
from foretell.engine.scheduler import Scheduler
from foretell.engine.sequence import Sequence
from foretell.engine.step_costs import start_adaptive_speculation
from foretell.engine.warm_up import warm_up
from foretell.runner.handle import RUNNER_LOST, start_runner
from foretell.runner.jit_counter import jit_compile_counter
from foretell.sampling_params import SamplingParams
from foretell.spec_decode.metrics import SpecDecodeStats
from foretell.tokenizer import IncrementalDetokenizer, Tokenizer, eos_ids_from_configs

logger = logging.getLogger("foretell")


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model
        self.tokenizer = None if mc.skip_tokenizer_init else Tokenizer(mc.tokenizer or mc.model)
        self.eos_token_ids = (
            self.tokenizer.eos_token_ids if self.tokenizer else eos_ids_from_configs(mc.model)
        )
        self.runner = start_runner(config)
        self.facts = facts = self.runner.describe()
        plan = facts.cache_plan
        self.block_manager = BlockManager(
            plan.num_blocks,
            plan.block_size,
            config.cache.enable_prefix_caching,
            reuse_margin_blocks=1 if facts.draft_kv_reads_next_token else 0,
        )
        k = config.speculative.num_speculative_tokens if config.speculative else 0
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, facts.max_model_len,
            num_lookahead_tokens=facts.num_lookahead_tokens,
            keep_draft_rows=facts.keep_draft_rows,
        )
        self.metrics = EngineMetrics(
            spec=SpecDecodeStats(k) if k else None,
            synthetic_acceptance=facts.synthetic_acceptance,
        )
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        mode = config.model.warm_up
        self.warm_up_seconds = 0.0
        self.adaptive = None  # set after the warm-up, whose compile-bound steps must not teach it costs
        if mode == "on" or (mode == "auto" and facts.device.startswith("cuda")):
            self.warm_up_seconds = warm_up(self)
            logger.info("warm-up: %.1f s of dummy requests (Triton kernels compiled)", self.warm_up_seconds)
        # Adaptive speculation: its step costs are learned from the steps as they run (step()).
        self.adaptive = start_adaptive_speculation(self) if config.speculative and config.speculative.adaptive else None
        freeze = config.model.gc_freeze
        self.gc_frozen = freeze == "on" or (freeze == "auto" and facts.device.startswith("cuda"))
        if self.gc_frozen:  # (ModelConfig.gc_freeze) the garbage of start-up collected first
            gc.collect()
            gc.freeze()

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    def shutdown(self) -> None:
        """Stop the runner's worker processes (tensor parallelism; nothing to do on one device), and
        give the objects gc.freeze exempted back to the collector (this engine's may sit in cycles)."""
        self.runner.shutdown()
        if self.gc_frozen:
            gc.unfreeze()
            self.gc_frozen = False

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> None:
        """Queue a request. Raises ValueError (and queues nothing) for bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.facts.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        params = params.resolved_for(self.tokenizer, vocab)  # bad_words tokenized, token ids checked
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"shorten the prompt or raise --max-model-len"
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens is {params.max_tokens} and the prompt is {len(token_ids)} tokens: "
                f"together {len(token_ids) + params.max_tokens}, past max_model_len "
                f"{self.max_model_len}; ask for at most {self.max_model_len - len(token_ids)} "
                f"tokens (or leave max_tokens unset: up to max_model_len)"
            )
        seqs = [
            Sequence(
                next(self._seq_ids), request_id, i, token_ids, params, self.eos_token_ids
            )
            for i in range(params.n)
        ]
        for seq in seqs:
            self.scheduler.add(seq)  # validates capacity; raises before anything is queued
        self.requests[request_id] = Request(
            request_id,
            text,
            token_ids,
            params,
            seqs,
            [IncrementalDetokenizer(self.tokenizer, params) if self.tokenizer else None for _ in seqs],
            RequestMetrics(arrival_time=time.monotonic()),
        )
        self.metrics.prompt_tokens_total += len(token_ids)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        needs_text = isinstance(prompt, str) or (
            isinstance(prompt, dict) and "prompt_token_ids" not in prompt
        )
        if self.tokenizer is None and needs_text:
            raise ValueError(
                "the engine runs without a tokenizer (skip_tokenizer_init): give token-id prompts"
            )
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string, a list of token ids, or a dict with 'prompt_token_ids'; "
            f"got {type(prompt).__name__}"
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its KV blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self.runner.forget(seq.seq_id)
        request.aborted = True
        return output_processor.make_output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.runner.forget(seq.seq_id)
        if sched.is_empty:
            return []
        try:
            results = self.runner.execute(sched)
        except RUNNER_LOST:  # a worker died or fell out of step: nothing can run any more
            raise
        except Exception as error:  # noqa: BLE001 -- a failed step must not end other requests
            return self._fail_step(sched, error)
        metrics, times = self.metrics, self.runner.last_times
        metrics.num_steps += 1
        metrics.target_time_s += times.target_s
        metrics.draft_time_s += times.draft_s
        touched: dict[str, Request] = {}
        now = time.monotonic()
        requests = self.requests
        for item, result in zip(sched.scheduled, results):
            request = requests.get(item.seq.request_id)
            if request is None or request.error is not None:
                continue  # failed earlier in this loop (another of its n samples)
            try:
                if self._apply_result(item, result, request, now):
                    touched[request.request_id] = request
            except Exception as error:  # noqa: BLE001 -- one sequence's failure is its request's alone
                touched[request.request_id] = request
                self._fail_request(request, error)
        outputs = self._finish_step(touched, now)
        if self.adaptive is not None:  # its cost model learns from the step (results read: no sync)
            self.adaptive.record_step(time.perf_counter() - start, len(sched.scheduled), sched.num_tokens)
        return outputs

    def _fail_step(self, sched, error: Exception) -> list[RequestOutput]:
        """The runner raised inside a step. A SequenceError names its sequence: that request
        fails alone. Anything else cannot be pinned on one request: every request of the step
        fails. Either way the engine stays usable: failed requests free their blocks, and the
        others, whose step never completed, redo it from where they were (without their drafts,
        whose probabilities the failed step may have consumed)."""
        now = time.monotonic()
        scheduled = [item.seq for item in sched.scheduled]
        self.runner.abandon_step([seq.seq_id for seq in scheduled])
        culprit = error.seq_id if isinstance(error, SequenceError) else None
        if not any(seq.seq_id == culprit for seq in scheduled):
            culprit = None
            logger.exception("engine step failed; failing the %d requests of the step", len(scheduled))
        failed: dict[str, Request] = {}
        for seq in scheduled:
            request = self.requests.get(seq.request_id)
            if request is None:
                continue
            if culprit is None or seq.seq_id == culprit:
                failed[request.request_id] = request
            elif not seq.is_finished:
                seq.spec_token_ids = []
        for request in failed.values():
            self._fail_request(request, error)
        return self._finish_step(failed, now)

    def _fail_request(self, request: Request, error: Exception) -> None:
        """Finish every sequence of the request with finish_reason "error" and free its blocks;
        RequestOutput.error says what went wrong."""
        message = str(error) if isinstance(error, SequenceError) else f"{type(error).__name__}: {error}"
        request.error = f"request failed inside an engine step: {message}"
        for seq in request.seqs:
            if not seq.is_finished:  # a sample that already ended keeps its own reason
                self.scheduler.finish(seq, "error")
            self.runner.forget(seq.seq_id)

    def _apply_result(self, item, result, request: Request, now: float) -> bool:
        """One sequence's share of the step (output_processor.apply_result), then the runner's
        side: forget a finished sequence, or keep its next drafts. Returns whether it produced
        output."""
        if not output_processor.apply_result(item, result, request, now, self.scheduler, self.metrics):
            return False
        seq = item.seq
        if seq.is_finished:
            self.runner.forget(seq.seq_id)
        elif seq.sampling_params.use_speculation:
            seq.spec_token_ids = result.next_drafts
        return True

    def _finish_step(self, touched: dict[str, Request], now: float) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            output = output_processor.make_output(request)
            outputs.append(output)
            if output.finished:  # request.finished, as make_output found it
                request.metrics.finished_time = now
                self.metrics.num_requests_finished += 1
                del self.requests[request.request_id]
        interval = self.config.log_stats_interval_s
        if interval > 0 and self.metrics.log_due(interval):  # off or not due: one comparison
            self.metrics.log(len(self.scheduler.running), len(self.scheduler.waiting), self.block_manager.usage)
        return outputs

    # ---- stats ---------------------------------------------------------------------
    def get_stats(self) -> dict:
        stats = self.metrics.as_dict()
        if self.adaptive is not None:
            stats.update(self.adaptive.stats())  # the chosen draft lengths, estimates, step costs
        stats.update(self.runner.runner_stats())  # the suffix gate's bar, steps queued ahead, ...
        if self.facts.synthetic_acceptance:
            stats["synthetic_acceptance"] = True  # accept decisions were drawn, text is synthetic
        stats.update(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_kv_blocks=self.block_manager.num_blocks,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            jit_compiles=jit_compile_counter().count,  # Triton compilations in this process
            prefix_cache_hit_rate=(
                self.block_manager.prefix_hits / self.block_manager.prefix_queries
                if self.block_manager.prefix_queries
                else 0.0
            ),
        )
        return stats
