"""Prometheus metrics of one server, in a registry of its own (never the global one).

Names follow vLLM's under the `foretell:` prefix. The engine already counts tokens, requests and
speculative drafts, so those are read from its stats snapshot at scrape time (a custom collector:
no double bookkeeping, no drift); the latency histograms are observed when a request finishes.

Exposed names (counters get Prometheus' `_total` suffix, histograms `_bucket/_sum/_count`):
  foretell:num_requests_running, foretell:num_requests_waiting, foretell:kv_cache_usage_perc,
  foretell:num_preemptions_total, foretell:prompt_tokens_total, foretell:generation_tokens_total,
  foretell:jit_compiles_total (Triton kernel compilations in the server process since start-up,
  warm-up included: one that grows while serving is a latency spike some request paid),
  foretell:request_success_total{finished_reason: stop, length, abort, error}, foretell:time_to_first_token_seconds,
  foretell:time_per_output_token_seconds, foretell:e2e_request_latency_seconds,
  foretell:spec_decode_num_drafts_total, foretell:spec_decode_num_draft_tokens_total,
  foretell:spec_decode_num_accepted_tokens_total,
  foretell:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from foretell.engine.outputs import RequestOutput

PREFIX = "foretell:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineStatsCollector(Collector):
    """Gauges and counters straight from Engine.get_stats() (the engine thread's snapshot)."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]], model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats() or {}
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests running in the engine (prefill or decode).",
                    stats.get("num_requests_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.get("num_requests_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                    stats.get("kv_cache_usage", 0.0))
        yield counter("num_preemptions", "Sequences preempted (recomputed) for lack of KV blocks.",
                      stats.get("num_preemptions", 0))
        yield counter("prompt_tokens", "Prompt tokens received.", stats.get("prompt_tokens_total", 0))
        yield counter("generation_tokens", "Tokens generated.",
                      stats.get("generation_tokens_total", 0))
        yield counter("jit_compiles", "Triton kernel compilations in this process since start-up.",
                      stats.get("jit_compiles", 0))
        if "num_drafts" not in stats:
            return  # no speculative decoding configured
        yield counter("spec_decode_num_drafts", "Verify steps that carried drafts.",
                      stats["num_drafts"])
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      stats["num_draft_tokens"])
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      stats["num_accepted_tokens"])
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first draft token).",
            labels=["model_name", "position"],
        )
        for position, accepted in enumerate(stats.get("accepted_per_position", [])):
            per_pos.add_metric([self.model_name, str(position)], accepted)
        yield per_pos


class ServerMetrics:
    """The registry one app exposes at /metrics, and the per-request latency histograms."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))
        labels = ["model_name"]
        self.model_name = model_name
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first output token.",
            labels, buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            labels, buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last output token.",
            labels, buckets=E2E_BUCKETS, registry=self.registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Called once per finished engine request (on the event loop)."""
        reasons = {c.finish_reason for c in output.outputs}
        reason = next((r for r in ("error", "abort", "length") if r in reasons), "stop")
        self.request_success.labels(self.model_name, reason).inc()
        m = output.metrics
        if m is None or m.first_token_time is None:
            return
        self.time_to_first_token.labels(self.model_name).observe(m.first_token_time - m.arrival_time)
        if m.finished_time is None:
            return  # aborted: no end time
        self.e2e_request_latency.labels(self.model_name).observe(m.finished_time - m.arrival_time)
        num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        if num_tokens > 1:
            tpot = (m.finished_time - m.first_token_time) / (num_tokens - 1)
            self.time_per_output_token.labels(self.model_name).observe(tpot)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
