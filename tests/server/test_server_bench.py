"""`foretell bench serve --concurrency`: latency under load against the tiny fixture server, one
closed-loop run per level with prompts of distinct lengths, none shared between levels; the
table and the JSON report percentiles of TTFT, TPOT and ITL per level."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from foretell.bench.datasets import Prompt  # noqa: E402
from foretell.bench.serve_load import (  # noqa: E402
    parse_concurrencies,
    prompt_length,
    prompts_of_distinct_lengths,
)
from foretell.cli import main  # noqa: E402


def test_distinct_lengths_and_levels():
    prompts = [Prompt(text="a" * n, source=str(i)) for i, n in enumerate([3, 5, 3, 7, 5, 1])]
    distinct = prompts_of_distinct_lengths(prompts, seed=0)
    assert sorted(prompt_length(p) for p in distinct) == [1, 3, 5, 7]
    assert {p.source for p in distinct} == {"0", "1", "3", "5"}  # the first of each length
    assert prompts_of_distinct_lengths(prompts, seed=0) == distinct  # seeded order
    assert prompt_length(Prompt(text=None, token_ids=[1, 2, 3], source="ids")) == 3
    assert parse_concurrencies("1,16, 64") == [1, 16, 64]
    for bad in ("", "0,4", "a,b", "1.5"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_concurrencies(bad)


def test_bench_serve_concurrency_sweep(server, tmp_path, capsys):
    path = tmp_path / "sweep.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset", "gsm8k", "--concurrency", "1,3",
               "--num-prompts", "3", "--max-tokens", "4", "--ignore-eos", "--output-json", str(path),
               "--no-progress"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["concurrencies"] == [1, 3] and report["requests_per_level"] == 3
    assert not report["prompts_reused"] and report["distinct_prompt_lengths"] > 6
    lengths = [n for level in report["levels"] for n in level["prompt_lengths"]]
    assert len(set(lengths)) == 6  # distinct lengths, none shared between the levels
    for level, concurrency in zip(report["levels"], [1, 3]):
        assert level["concurrency"] == concurrency == level["max_concurrency"]
        assert (level["completed"], level["failed"]) == (3, 0)
        assert level["total_output_tokens"] == 12 and level["token_count_source"] == "usage"
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            stats = level[name]
            assert set(stats) == {"mean", "std", "p50", "p90", "p99"}
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| concurrency"))
    assert "TTFT p50" in header and "TPOT p99" in header and "ITL p90" in header
    assert "median" not in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert len(rows) == 2
