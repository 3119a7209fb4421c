"""The offline sweep: one model, no speculation plus every (method, k), at every batch size.

Each configuration gets one LLM; each batch size is a closed-loop run that keeps `batch_size`
requests in flight (a new one enters as soon as one finishes) over the same token-id prompts.
Counters are read as deltas of llm.get_stats() around the run, step times from the runner after
each engine step. Speedup is tokens/s against no speculation at the same batch size in this run.

Predicted speedup of a chain (per issue 7): mean_acceptance_length / (1 + k * c), with
c = draft cost per token / verify step cost, i.e. k * c = draft step time / verify step time.
The step model refines it with the measured tokens per sequence step and the verify step's cost
relative to a plain decode step: L_eff * decode_step / (verify_step + draft_step).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from foretell.bench.report import acceptance_counters
from foretell.speculative_config import SPECULATIVE_METHODS, SpeculativeConfig

DRAFT_MODEL_METHODS = ("eagle3", "draft_model")  # methods that need speculative_config["model"]


def parse_int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; a clear error for anything else (empty items, non-integers, values
    below minimum, duplicates)."""
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise ValueError(f"{flag} must be a comma-separated list of integers, got {text!r}")
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not an integer (in {text!r})") from None
        if value < minimum:
            raise ValueError(f"{flag}: every value must be >= {minimum}, got {value} (in {text!r})")
        values.append(value)
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} lists a value twice: {text!r}")
    return values


def parse_k_list(text: str) -> list[int | str]:
    """--k: "1,2,4,auto" -> [1, 2, 4, "auto"] (auto: adaptive speculation)."""
    items = [item.strip() for item in str(text).split(",")]
    numbers = ",".join(item for item in items if item != "auto")
    values: list[int | str] = parse_int_list(numbers, "--k") if numbers else []
    if items.count("auto") > 1:
        raise ValueError(f"--k lists auto twice: {text!r}")
    return values + (["auto"] if "auto" in items else [])


def adaptive_counters(before: dict, after: dict) -> dict[str, Any]:
    """What adaptive speculation chose over a run: its histogram of chosen k and their mean."""
    after_hist = after.get("adaptive_chosen_k_histogram")
    if after_hist is None:
        return {}
    before_hist = before.get("adaptive_chosen_k_histogram") or [0] * len(after_hist)
    histogram = [a - b for a, b in zip(after_hist, before_hist)]
    steps = sum(histogram)
    return {
        "adaptive_chosen_k_histogram": histogram,
        "adaptive_mean_chosen_k": sum(k * n for k, n in enumerate(histogram)) / steps if steps else None,
    }


def parse_float_list(text: str, flag: str) -> list[float]:
    """"50,90,99" -> [50.0, 90.0, 99.0]: percentiles, each in (0, 100]."""
    try:
        values = [float(item) for item in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not all(0 < v <= 100 for v in values):
        raise ValueError(f"{flag}: every value must be in (0, 100], got {text!r}")
    return values


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in str(text).split(",")]
    for m in methods:
        if m not in SPECULATIVE_METHODS:
            raise ValueError(
                f"--methods: unknown speculative method {m!r}; choose from "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods lists a method twice: {text!r}")
    return methods


def speculative_configs(
    methods: list[str], ks: list[int], method_models: dict[str, str], extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """One speculative_config per (method, k), validated now so that a mistake shows before
    any model is loaded."""
    configs = []
    for method in methods:
        for k in ks:
            config = dict(extra)
            config.update(method=method, num_speculative_tokens=k)
            if method in method_models:
                config["model"] = method_models[method]
            elif method not in DRAFT_MODEL_METHODS:
                config.pop("model", None)  # a draft folder given for eagle3 is not mtp's
            SpeculativeConfig.from_any(config)
            configs.append(config)
    return configs


@dataclass
class LoadRun:
    """What one closed-loop run measured."""

    outputs: list[list[int]]  # per request, the generated token ids
    wall_s: float
    step_target_s: list[float]
    step_draft_s: list[float]
    stats_before: dict
    stats_after: dict
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


_request_ids = itertools.count()


def run_closed_loop(
    llm, requests: list[dict], params, concurrency: int, on_finish: Callable[[], None] | None = None
) -> LoadRun:
    """Keep `concurrency` requests in flight until all of `requests` are done."""
    engine = llm.engine
    before = llm.get_stats()
    outputs: list[list[int] | None] = [None] * len(requests)
    in_flight: dict[str, int] = {}
    step_target, step_draft, ttft, tpot = [], [], [], []
    next_index, idle_steps = 0, 0
    start = time.perf_counter()
    try:
        while next_index < len(requests) or in_flight:
            while next_index < len(requests) and len(in_flight) < concurrency:
                request_id = f"bench-{next(_request_ids)}"
                engine.add_request(request_id, requests[next_index], params)
                in_flight[request_id] = next_index
                next_index += 1
            steps_before = engine.metrics.num_steps
            finished = [o for o in engine.step() if o.finished and o.request_id in in_flight]
            if engine.metrics.num_steps == steps_before:
                idle_steps += 1
                if idle_steps > 1000:
                    raise RuntimeError("the engine stopped making progress during the benchmark")
                continue
            idle_steps = 0
            step_target.append(engine.runner.last_times.target_s)
            step_draft.append(engine.runner.last_times.draft_s)
            for out in finished:
                outputs[in_flight.pop(out.request_id)] = list(out.outputs[0].token_ids)
                m = out.metrics
                if m is not None and m.first_token_time is not None:
                    ttft.append(m.first_token_time - m.arrival_time)
                    n = len(out.outputs[0].token_ids)
                    if m.finished_time is not None and n > 1:
                        tpot.append((m.finished_time - m.first_token_time) / (n - 1))
                if on_finish is not None:
                    on_finish()
    except BaseException:
        for request_id in in_flight:
            engine.abort_request(request_id)
        raise
    wall = time.perf_counter() - start
    return LoadRun(outputs, wall, step_target, step_draft, before, llm.get_stats(), ttft, tpot)


def spec_counters(before: dict, after: dict, k: int) -> dict[str, Any]:
    """The speculative counters of a run (after - before) and what follows from them."""
    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    def delta_list(name, length):
        a, b = after.get(name) or [0] * length, before.get(name) or [0] * length
        return [x - y for x, y in zip(a, b)]

    drafts, accepted = delta("num_drafts"), delta("num_accepted_tokens")
    draft_tokens = delta("num_draft_tokens")
    histogram = delta_list("accepted_count_histogram", k + 1)
    total = sum(histogram)
    per_position = delta_list("accepted_per_position", k)
    return {
        **acceptance_counters(drafts, draft_tokens, accepted, per_position),
        "accepted_count_histogram": histogram,
        "accepted_count_distribution": [c / total if total else 0.0 for c in histogram],
    }


def _median_ms(values: list[float]) -> float | None:
    return 1000.0 * statistics.median(values) if values else None


def _mean_ms(values: list[float]) -> float | None:
    return 1000.0 * statistics.fmean(values) if values else None


def summarize(run: LoadRun, method: str, k: int, batch_size: int) -> dict[str, Any]:
    """One result row (speedup and baseline comparisons are filled in by the caller)."""
    before, after = run.stats_before, run.stats_after
    generated = sum(len(o) for o in run.outputs)
    target_s = after["target_time_s"] - before["target_time_s"]
    draft_s = after["draft_time_s"] - before["draft_time_s"]
    # Mean step times (what the wall clock adds up) drive the predictions; medians are kept
    # too, as the cost of a typical step when a few slow steps (prefills, a busy host) skew it.
    target_step = _mean_ms(run.step_target_s)
    draft_step = _mean_ms(run.step_draft_s) if k else None
    row: dict[str, Any] = {
        "method": method,
        "k": k,
        "batch_size": batch_size,
        "num_requests": len(run.outputs),
        "generated_tokens": generated,
        "wall_s": run.wall_s,
        "tokens_per_s": generated / run.wall_s if run.wall_s > 0 else None,
        "requests_per_s": len(run.outputs) / run.wall_s if run.wall_s > 0 else None,
        "ttft_ms_mean": _mean_ms(run.ttft_s),
        "tpot_ms_mean": _mean_ms(run.tpot_s),
        "num_steps": after["num_steps"] - before["num_steps"],
        "target_time_s": target_s,
        "draft_time_s": draft_s,
        # Time outside the target and the drafter: scheduling, bookkeeping, detokenizing.
        "overhead_fraction": 1.0 - (target_s + draft_s) / run.wall_s if run.wall_s > 0 else None,
        "target_step_ms": target_step,  # a decode step without speculation, else a verify step
        "draft_step_ms": draft_step,
        "target_step_ms_median": _median_ms(run.step_target_s),
        "draft_step_ms_median": _median_ms(run.step_draft_s) if k else None,
    }
    if not k:
        return row
    counters = spec_counters(before, after, k)
    accepted = counters["num_accepted_tokens"]
    ratio = draft_step / target_step if target_step else None
    mean_len = counters["mean_acceptance_length"]
    row.update(counters)
    row.update(adaptive_counters(before, after))
    row.update(
        draft_verify_ratio=ratio,
        draft_token_ms=draft_step / k if draft_step is not None else None,
        # Tokens per sequence step, counting the steps that drafted nothing (n-gram misses).
        tokens_per_sequence_step=(
            generated / (generated - accepted) if generated > accepted else None
        ),
        predicted_speedup=(mean_len or 1.0) / (1.0 + ratio) if ratio is not None else None,
    )
    return row


def add_comparisons(row: dict, baseline_row: dict, baseline_outputs, outputs, exact: bool) -> None:
    """Speedup against no speculation at the same batch size, the step-model prediction, and
    (when decoding is greedy and real) whether the tokens are the baseline's."""
    tps, base_tps = row.get("tokens_per_s"), baseline_row.get("tokens_per_s")
    row["speedup"] = tps / base_tps if tps and base_tps else None
    if row["k"]:
        steps = row["target_step_ms"], row["draft_step_ms"], baseline_row["target_step_ms"]
        l_eff = row.get("tokens_per_sequence_step")
        row["predicted_speedup_step_model"] = (
            l_eff * steps[2] / (steps[0] + steps[1]) if l_eff and all(steps) else None
        )
    if exact:
        mismatched = [i for i, (a, b) in enumerate(zip(outputs, baseline_outputs)) if a != b]
        row["matches_baseline"] = not mismatched
        row["num_mismatched_requests"] = len(mismatched)
    else:
        row["matches_baseline"] = None
        row["num_mismatched_requests"] = None


def release(llm) -> None:
    """Free an LLM's memory before the next configuration loads: LLM.close() frees it now (the
    caller's own reference would keep it alive past a collection here; on the H200 the suffix
    engine after the plain one found too little memory free and could not start)."""
    llm.close()
