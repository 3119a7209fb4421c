"""foretell bench: prompt sets, argument errors, the offline sweep end to end on tiny checkpoints
(report fields and their arithmetic, plots, agreement with transformers), and bench serve against
a small fake OpenAI-compatible server started here."""

from __future__ import annotations

import gc
import json
import math
import os
import threading
import time
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from foretell.bench import datasets
from foretell.bench.spec_metrics_scrape import parse_spec_metrics, spec_delta
from foretell.bench.sweep import parse_float_list, parse_int_list, parse_methods, spec_counters
from foretell.cli import main

# ------------------------------------------------------------------------------ prompt sets


@pytest.mark.parametrize("name, count", [("gsm8k", 1319), ("mt_bench", 80), ("humaneval", 164)])
def test_shipped_datasets_load(name, count):
    everything = datasets.load_prompts(name, None)
    assert len(everything) == count
    assert all(p.text and p.token_ids is None for p in everything)
    some = datasets.load_prompts(name, 5, seed=3)
    assert len(some) == 5 and some == datasets.load_prompts(name, 5, seed=3)
    assert {p.source for p in some} <= {p.source for p in everything}


def test_gsm8k_prompt_format():
    first = datasets.load_prompts("gsm8k", None)[0]
    assert first.text.startswith("Question: ") and first.text.endswith("\nAnswer:")


def test_random_prompts_have_exact_length_and_avoid_specials():
    prompts = datasets.load_prompts("random", 4, seed=1, input_len=7, vocab=range(10, 20))
    assert [len(p.token_ids) for p in prompts] == [7] * 4
    assert all(10 <= t < 20 for p in prompts for t in p.token_ids)
    with pytest.raises(ValueError, match="input-len"):
        datasets.load_prompts("random", 4, input_len=0, vocab=range(5))


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown dataset 'squad'.*gsm8k.*mt_bench.*random"):
        datasets.load_prompts("squad", 4)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datasets.load_prompts("/no/such/prompts.jsonl", 4)


def test_prompt_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '"plain string"\n\n{"prompt": "a"}\n{"question": "q"}\n{"turns": ["t1", "t2"]}\n'
        '{"prompt_token_ids": [1, 2, 3]}\n'
    )
    prompts = datasets.load_prompts(str(path), None)
    assert [p.text for p in prompts] == ["plain string", "a", "q", "t1", None]
    assert prompts[-1].token_ids == [1, 2, 3]
    assert len(datasets.load_prompts(str(path), 2)) == 2


@pytest.mark.parametrize("content, message", [
    ("", "has no prompts"),
    ("\n  \n", "has no prompts"),
    ('{"prompt": "a"}\n{not json\n', "line 2: not valid JSON"),
    ('{"answer": "x"}\n', "found none of the keys"),
    ('{"prompt": ""}\n', "non-empty string"),
    ('{"prompt_token_ids": []}\n', "non-empty list of integers"),
    ("[1, 2]\n", "expected a JSON string or object"),
])
def test_bad_prompt_files(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        datasets.load_prompts(str(path), None)


# ------------------------------------------------------------------------------ arguments


def test_parse_lists():
    assert parse_int_list("1, 2,4", "--k") == [1, 2, 4]
    assert parse_methods("ngram,draft_model") == ["ngram", "draft_model"]
    assert parse_float_list("50,99.9", "--percentiles") == [50.0, 99.9]
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        parse_methods("ngram,medusa")
    with pytest.raises(ValueError, match=r"in \(0, 100\]"):
        parse_float_list("0,50", "--percentiles")


@pytest.mark.parametrize("text, message", [
    ("", "comma-separated list"),
    ("1,,2", "comma-separated list"),
    ("1,x", "'x' is not an integer"),
    ("1.5", "'1.5' is not an integer"),
    ("0,1", ">= 1, got 0"),
    ("-2", ">= 1, got -2"),
    ("2,2", "twice"),
])
def test_bad_k_lists(text, message):
    with pytest.raises(ValueError, match=message):
        parse_int_list(text, "--k")


@pytest.mark.parametrize("extra, message", [
    (["--methods", "ngram", "--k", "1,,3"], "--k must be a comma-separated list"),
    (["--methods", "ngram", "--k", "0"], "--k: every value must be >= 1"),
    (["--k", "1,2"], "--k needs speculative methods"),
    (["--methods", "ngram", "--batch-sizes", "0"], "--batch-sizes"),
    (["--methods", "draft_model"], "needs a draft model folder"),
    (["--methods", "ngram", "--method-model", "eagle3=/x"], "--method-model"),
    (["--dataset", "squad"], "unknown dataset 'squad'"),
    (["--dataset", "EMPTY"], "has no prompts"),
])
def test_bench_cli_errors_before_loading(tmp_path, capsys, extra, message):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    extra = [str(empty) if a == "EMPTY" else a for a in extra]
    rc = main(["bench", "--model", str(tmp_path / "not-loaded"), "--no-progress", *extra])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_bench_without_model_or_default_models(capsys, tmp_path, monkeypatch):
    """No --model: the default family (tests/test_cli_first_hour.py); when it is not installed,
    a clear error that names --model."""
    from foretell import defaults

    monkeypatch.setattr(defaults, "DEFAULT_MODELS_DIR", str(tmp_path / "none"))
    assert main(["bench", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no default model is installed" in err and "--model" in err


def test_speculative_configs_pass_extra_keys_through():
    from foretell.bench.sweep import speculative_configs

    extra = {"simulate_acceptance": {"mean_acceptance_length": 2.5}, "prompt_lookup_max": 3}
    configs = speculative_configs(["ngram", "draft_model"], [1, 4], {"draft_model": "/d"}, extra)
    assert [(c["method"], c["num_speculative_tokens"]) for c in configs] == [
        ("ngram", 1), ("ngram", 4), ("draft_model", 1), ("draft_model", 4)]
    assert all(c["simulate_acceptance"] == extra["simulate_acceptance"] for c in configs)
    assert "model" not in configs[0] and configs[2]["model"] == "/d"


def test_spec_counters_are_deltas():
    before = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
              "accepted_per_position": [2, 1, 0], "accepted_count_histogram": [0, 1, 1, 0]}
    after = {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 11,
             "accepted_per_position": [6, 4, 1], "accepted_count_histogram": [0, 2, 1, 3]}
    c = spec_counters(before, after, 3)
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (4, 12, 8)
    assert c["accepted_per_position"] == [4, 3, 1]
    assert c["accepted_count_histogram"] == [0, 1, 0, 3]
    assert c["acceptance_rate"] == pytest.approx(8 / 12)
    assert c["mean_acceptance_length"] == pytest.approx(3.0)
    assert c["acceptance_per_position"] == pytest.approx([1.0, 0.75, 0.25])


# ------------------------------------------------------------------------------ the sweep

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def sweep(qwen3_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_dir = out / "bench.json", out / "plots"
    argv = [
        "bench", "--model", qwen3_checkpoint, "--device", "cpu", "--methods", "ngram,draft_model",
        "--draft-model", qwen3_checkpoint,  # a draft equal to the target: every draft accepted
        "--k", "2", "--batch-sizes", "1,2", "--dataset", "gsm8k", "--num-prompts", "2",
        "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--compare", "hf",
        "--output-json", str(json_path), "--plot-dir", str(plot_dir), "--no-progress",
    ]
    rc = main(argv)
    assert rc == 0
    with open(json_path) as f:
        return json.load(f), plot_dir


ROW_FIELDS = (
    "method", "k", "batch_size", "num_requests", "generated_tokens", "wall_s", "tokens_per_s",
    "speedup", "num_steps", "target_step_ms", "draft_step_ms", "matches_baseline",
    "ttft_ms_mean", "tpot_ms_mean", "overhead_fraction",
)
SPEC_FIELDS = (
    "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
    "mean_acceptance_length", "accepted_per_position", "acceptance_per_position",
    "accepted_count_histogram", "accepted_count_distribution", "draft_verify_ratio",
    "draft_token_ms", "predicted_speedup", "predicted_speedup_step_model",
)


def test_sweep_report_fields(sweep):
    report, _ = sweep
    for key in ("model", "device", "dtype", "dataset", "batch_sizes", "results", "hf_comparison"):
        assert key in report
    assert report["dataset"]["num_prompts"] == 2
    configs = [(r["method"], r["k"], r["batch_size"]) for r in report["results"]]
    assert configs == [(m, k, b) for m, k in [("none", 0), ("ngram", 2), ("draft_model", 2)]
                       for b in (1, 2)]
    for row in report["results"]:
        assert all(f in row for f in ROW_FIELDS), row
        if row["k"]:
            assert all(f in row for f in SPEC_FIELDS), row


def test_sweep_numbers_are_consistent(sweep):
    report, _ = sweep
    rows = report["results"]
    base = {r["batch_size"]: r for r in rows if r["method"] == "none"}
    for r in rows:
        assert r["num_requests"] == 2  # max(num_prompts, batch size)
        assert r["generated_tokens"] == r["num_requests"] * MAX_TOKENS  # --ignore-eos
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        base_tps = base[r["batch_size"]]["tokens_per_s"]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base_tps)
        assert r["matches_baseline"] is True and r["num_mismatched_requests"] == 0
        if not r["k"]:
            continue
        hist, per_pos = r["accepted_count_histogram"], r["accepted_per_position"]
        assert len(hist) == r["k"] + 1 and len(per_pos) == r["k"]
        assert sum(hist) == r["num_drafts"]
        assert sum(i * h for i, h in enumerate(hist)) == r["num_accepted_tokens"] == sum(per_pos)
        assert r["num_accepted_tokens"] <= r["num_draft_tokens"] <= r["k"] * r["num_drafts"]
        if r["num_drafts"]:
            assert r["mean_acceptance_length"] == pytest.approx(
                1 + r["num_accepted_tokens"] / r["num_drafts"])
            assert r["acceptance_rate"] == pytest.approx(
                r["num_accepted_tokens"] / r["num_draft_tokens"])
            assert r["acceptance_per_position"] == pytest.approx(
                [a / r["num_drafts"] for a in per_pos])
        assert r["draft_verify_ratio"] == pytest.approx(r["draft_step_ms"] / r["target_step_ms"])
        assert r["predicted_speedup"] == pytest.approx(
            (r["mean_acceptance_length"] or 1.0) / (1 + r["draft_verify_ratio"]))
    # A draft model identical to the target proposes exactly the target's greedy tokens.
    for r in rows:
        if r["method"] == "draft_model":
            assert r["num_drafts"] > 0 and r["acceptance_rate"] == 1.0
            assert r["mean_acceptance_length"] > 1.5


def test_sweep_agrees_with_transformers(sweep):
    comparison = sweep[0]["hf_comparison"]
    modes = {(r["method"], r["hf_mode"]) for r in comparison["rows"]}
    assert modes == {("none", "generate"), ("ngram", "prompt lookup"),
                     ("draft_model", "assisted generation")}
    for row in comparison["rows"]:
        assert row["num_prompts"] == 2 and row["agree"], row
        assert row["hf_generated_tokens"] == 2 * MAX_TOKENS and row["hf_tokens_per_s"] > 0


def test_sweep_plots_written(sweep):
    _, plot_dir = sweep
    from foretell.bench.plots import PLOT_FILES

    for name in PLOT_FILES:
        path = os.path.join(plot_dir, name)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
        assert os.path.getsize(path) > 5000


def test_sweep_table_text(sweep):
    from foretell.bench.report import sweep_summary

    text = sweep_summary(sweep[0])
    assert "| method" in text and "| draft_model | 2 | 2" in text
    assert "Hugging Face transformers" in text and "WARNING" not in text


def test_random_dataset_without_speculation(qwen3_checkpoint, tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main(["bench", "--model", qwen3_checkpoint, "--device", "cpu", "--dataset", "random",
               "--input-len", "5",
               "--num-prompts", "2", "--max-tokens", "3", "--ignore-eos", "--no-warmup",
               "--output-json", str(path), "--plot-dir", str(tmp_path / "plots"),
               "--no-progress"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["dataset"]["mean_prompt_tokens"] == 5
    [row] = report["results"]
    assert row["method"] == "none" and row["generated_tokens"] == 6 and row["speedup"] == 1.0
    assert "| none" in capsys.readouterr().out
    assert len(os.listdir(tmp_path / "plots")) == 4  # plots of a run without speculation


def test_each_configuration_frees_the_last_engine_before_loading(qwen3_checkpoint, tmp_path, monkeypatch):
    """No name in run_bench keeps an engine's runner (its KV cache) alive once the next method's
    engine loads: on the H200 the suffix engine after the plain one found 15.7 GiB free."""
    import foretell

    runners: list[weakref.ref] = []
    alive_at_load: list[int] = []

    class WatchedLLM(foretell.LLM):
        def __init__(self, *args, **kwargs):
            gc.collect()
            alive_at_load.append(sum(ref() is not None for ref in runners))
            super().__init__(*args, **kwargs)
            runners.append(weakref.ref(self.engine.runner))

    monkeypatch.setattr(foretell, "LLM", WatchedLLM)
    rc = main(["bench", "--model", qwen3_checkpoint, "--device", "cpu", "--methods", "ngram,suffix",
               "--dataset", "random", "--input-len", "5", "--num-prompts", "1", "--max-tokens", "2",
               "--ignore-eos", "--no-warmup", "--output-json", str(tmp_path / "r.json"), "--no-progress"])
    assert rc == 0 and len(runners) == 3
    assert alive_at_load == [0, 0, 0]


# ------------------------------------------------------------------------------ bench serve

METRICS_TEMPLATE = """\
# HELP foretell:spec_decode_num_drafts Number of draft proposals.
# TYPE foretell:spec_decode_num_drafts counter
foretell:spec_decode_num_drafts_total{{model_name="fake"}} {drafts}
foretell:spec_decode_num_drafts_created{{model_name="fake"}} 1.7e9
foretell:spec_decode_num_draft_tokens_total{{model_name="fake"}} {draft_tokens}
foretell:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {accepted}
foretell:spec_decode_num_accepted_tokens_per_pos_total{{model_name="fake",position="0"}} {pos0}
foretell:spec_decode_num_accepted_tokens_per_pos_total{{model_name="fake",position="1"}} {pos1}
foretell:generation_tokens_total{{model_name="fake"}} 123
"""


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens one-token chunks (2 ms apart) and a usage block; every request adds
    2 drafts of 2 tokens with 3 accepted (position 0: 2, position 1: 1) to /metrics."""

    requests_done = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, code, body, content_type="application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}))
        elif self.path == "/metrics":
            n = FakeOpenAI.requests_done
            self._send(200, METRICS_TEMPLATE.format(
                drafts=2 * n, draft_tokens=4 * n, accepted=3 * n, pos0=2 * n, pos1=n),
                "text/plain; version=0.0.4")
        else:
            self._send(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("model") != "fake-model":
            self._send(404, json.dumps({"error": {"message": f"no model {body.get('model')}"}}))
            return
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def event(obj):
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        if chat:
            event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(body["max_tokens"]):
            time.sleep(0.002)
            piece = f"w{i} "
            event({"choices": [{"index": 0, "delta": {"content": piece}} if chat
                               else {"index": 0, "text": piece}]})
        event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"],
                                        "total_tokens": 7 + body["max_tokens"]}})
        with FakeOpenAI.lock:  # counted before [DONE], so /metrics read after it includes it
            FakeOpenAI.requests_done += 1
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_parse_spec_metrics_any_prefix():
    text = METRICS_TEMPLATE.format(drafts=4, draft_tokens=8, accepted=6, pos0=4, pos1=2)
    parsed = parse_spec_metrics(text)
    assert parsed["totals"] == {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6}
    assert parsed["per_position"] == {0: 4, 1: 2}
    assert parse_spec_metrics(text.replace("foretell:", "vllm:")) == parsed
    assert parse_spec_metrics("# nothing\nother_metric 1\n") is None
    delta = spec_delta(parsed, parse_spec_metrics(
        METRICS_TEMPLATE.format(drafts=6, draft_tokens=12, accepted=9, pos0=6, pos1=3)))
    assert delta["acceptance_rate"] == pytest.approx(0.75)
    assert delta["mean_acceptance_length"] == pytest.approx(2.5)
    assert delta["acceptance_per_position"] == pytest.approx([1.0, 0.5])


def test_bench_serve_completions(fake_server, tmp_path, capsys):
    path = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", fake_server, "--dataset", "mt_bench",
               "--num-prompts", "6", "--max-tokens", "5", "--max-concurrency", "3",
               "--output-json", str(path), "--no-progress"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["model"] == "fake-model" and report["endpoint"] == "/v1/completions"
    assert (report["completed"], report["failed"]) == (6, 0)
    assert report["total_output_tokens"] == 30 and report["total_prompt_tokens"] == 42
    assert report["token_count_source"] == "usage"
    assert report["output_throughput"] == pytest.approx(30 / report["duration_s"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = report[name]
        assert set(stats) == {"mean", "std", "p50", "p90", "p99"}  # p50 is the median
        assert 0 < stats["p50"] <= stats["p99"]
    assert report["ttft_ms"]["mean"] < report["e2el_ms"]["mean"]
    spec = report["spec_decode"]
    assert spec["num_drafts"] == 12 and spec["num_accepted_tokens"] == 18
    assert spec["acceptance_rate"] == pytest.approx(0.75)
    assert spec["mean_acceptance_length"] == pytest.approx(2.5)
    assert spec["acceptance_per_position"] == pytest.approx([1.0, 0.5])
    out = capsys.readouterr().out
    assert "TTFT" in out and "mean acceptance length 2.50" in out


def test_bench_serve_chat_with_request_rate(fake_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hello"\n"how are you"\n"bye"\n')
    path = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", fake_server, "--api", "chat",
               "--dataset", str(prompts), "--max-tokens", "4", "--request-rate", "50",
               "--metrics-url", "", "--output-json", str(path), "--no-progress"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["endpoint"] == "/v1/chat/completions" and report["request_rate"] == 50
    assert report["completed"] == 3 and report["total_output_tokens"] == 12
    assert report["spec_decode"] is None and report["metrics_url"] is None


def test_bench_serve_reports_failures(fake_server, tmp_path):
    path = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", fake_server, "--model", "other",
               "--num-prompts", "2", "--max-tokens", "3", "--output-json", str(path),
               "--no-progress"])
    assert rc == 1
    report = json.loads(path.read_text())
    assert report["failed"] == 2 and "HTTP 404" in report["errors"][0]
    assert report["ttft_ms"]["mean"] is None


def test_bench_serve_unreachable(capsys):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1",
               "--no-progress"])
    assert rc == 2
    assert "could not reach the server" in capsys.readouterr().err


def test_bench_serve_random_needs_tokenizer(capsys):
    assert main(["bench", "serve", "--dataset", "random", "--no-progress"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_percentile_summary_math():
    from foretell.bench.serve_summary import RequestResult, summarize_results

    results = [RequestResult(True, latency_s=1.0, ttft_s=0.1, itl_s=[0.3, 0.3, 0.3],
                             output_tokens=4, prompt_tokens=2, counted_from_usage=True),
               RequestResult(False, error="boom")]
    s = summarize_results(results, 2.0, [50.0])
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, ["boom"])
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert s["itl_ms"]["p50"] == pytest.approx(300.0)
    assert s["total_token_throughput"] == pytest.approx(3.0)
    assert not math.isnan(s["e2el_ms"]["std"])


def test_profile_decode_finds_the_idle_gaps_of_a_step_timeline(monkeypatch):
    """scripts/profile_decode.py's idle_gaps: time between the end of everything started so far and
    the next operation (overlapped launches, as PDL makes them, are not gaps)."""
    import importlib.util

    scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
    spec = importlib.util.spec_from_file_location("profile_decode", os.path.join(scripts, "profile_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timeline = [{"op": "lm_head", "start_us": 0.0, "us": 10.0}, {"op": "gemv", "start_us": 5.0, "us": 20.0},
                {"op": "norm", "start_us": 8.0, "us": 2.0},  # inside the gemv: no gap
                {"op": "argmax", "start_us": 27.5, "us": 1.0}, {"op": "accept", "start_us": 32.0, "us": 1.0}]
    idle = module.idle_gaps(timeline)
    assert idle["idle_us"] == 6.0 and idle["gaps"] == 2
    assert idle["longest"][0] == {"us": 3.5, "after": "argmax", "before": "accept", "at_us": 28.5}
    assert idle["longest"][1]["after"] == "gemv" and idle["longest"][1]["us"] == 2.5
    assert module.idle_gaps([]) == {"idle_us": 0, "gaps": 0, "longest": []}
