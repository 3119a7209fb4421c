"""Text tables and JSON files for bench reports (offline sweep and serve load)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence


def acceptance_counters(drafts: float, draft_tokens: float, accepted: float,
                        accepted_per_position: list[float]) -> dict[str, Any]:
    """A run's speculative counters and the rates that follow from them (None / 0.0 where the run
    drafted nothing): acceptance rate, mean acceptance length (1 + accepted / drafts: the
    target's own token counts once per verify) and acceptance per position."""
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "accepted_per_position": accepted_per_position,
        "acceptance_per_position": [a / drafts if drafts else 0.0 for a in accepted_per_position],
    }


def fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (readable as plain text too, pastes into BENCHMARKS.md as is)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def per_position(values: list[float] | None) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


SWEEP_HEADERS = (
    "method", "k", "bs", "tok/s", "speedup", "predicted", "pred. (step)", "accept", "mean len",
    "per position", "draft ms", "verify ms", "draft/verify", "greedy = base",
)


SWEEP_NOTE = (
    "predicted = L / (1 + k c): L the mean acceptance length (tokens per verify step), k c the "
    "draft step time over the verify step time (draft/verify);\n"
    "pred. (step) = tokens per sequence step x plain decode step / (verify step + draft step); "
    "per position: the share of drafts whose i-th token was accepted"
)


def sweep_table(report: dict[str, Any]) -> str:
    rows = []
    for r in report["results"]:
        rows.append([
            r["method"], k_label(r), str(r["batch_size"]), fmt(r["tokens_per_s"], ".1f"),
            fmt(r.get("speedup"), ".2f"), fmt(r.get("predicted_speedup"), ".2f"),
            fmt(r.get("predicted_speedup_step_model"), ".2f"), fmt(r.get("acceptance_rate"), ".2f"),
            fmt(r.get("mean_acceptance_length"), ".2f"),
            per_position(r.get("acceptance_per_position")),
            fmt(r.get("draft_step_ms"), ".2f"), fmt(r.get("target_step_ms"), ".2f"),
            fmt(r.get("draft_verify_ratio"), ".2f"), fmt(r.get("matches_baseline")),
        ])
    return table(SWEEP_HEADERS, rows)


def k_label(row: dict[str, Any]) -> str:
    """The k column: k, or for adaptive speculation auto<=K and the mean k it chose."""
    if not row.get("adaptive"):
        return str(row["k"])
    mean = row.get("adaptive_mean_chosen_k")
    return f"auto<={row['k']} ({fmt(mean, '.2f')})"


def adaptive_lines(report: dict[str, Any]) -> list[str]:
    """Per adaptive row: how often each k was chosen."""
    lines = []
    for r in report["results"]:
        histogram = r.get("adaptive_chosen_k_histogram")
        if r.get("adaptive") and histogram is not None:
            total = sum(histogram) or 1
            shares = ", ".join(f"k={k} {100 * n / total:.0f}%" for k, n in enumerate(histogram))
            lines.append(f"{r['method']} auto bs={r['batch_size']}: chose {shares} (mean {fmt(r.get('adaptive_mean_chosen_k'))})")
    return lines


def hf_table(comparison: dict[str, Any]) -> str:
    headers = ("method", "k", "transformers mode", "HF tok/s (bs 1)",
               f"foretell tok/s (bs {comparison['foretell_batch_size']})", "same tokens")
    rows = [
        [r["method"], str(r["k"]), r["hf_mode"], fmt(r["hf_tokens_per_s"], ".1f"),
         fmt(r["foretell_tokens_per_s"], ".1f"), f"{r['num_agree']}/{r['num_prompts']}"]
        for r in comparison["rows"]
    ]
    return table(headers, rows)


def sweep_summary(report: dict[str, Any]) -> str:
    d = report["dataset"]
    head = (
        f"foretell bench: {report['model']} on {report['device']} ({report['dtype']}), dataset "
        f"{d['name']} ({d['num_prompts']} prompts, mean {d['mean_prompt_tokens']:.0f} tokens), "
        f"max_tokens {d['max_tokens']}, temperature {d['temperature']}"
    )
    parts = [head, "", sweep_table(report), "", SWEEP_NOTE]
    chosen = adaptive_lines(report)
    if chosen:
        parts += ["", "adaptive speculation, steps per chosen k (auto<=K (mean chosen k) in the table):", *chosen]
    if "hf_comparison" in report:
        parts += ["", "Hugging Face transformers, same prompts and token counts:", "",
                  hf_table(report["hf_comparison"])]
    mismatched = [r for r in report["results"] if r.get("matches_baseline") is False]
    if mismatched:
        parts += ["", "WARNING: greedy outputs differ from no speculation for: " + ", ".join(
            f"{r['method']} k={r['k']} bs={r['batch_size']}" for r in mismatched)]
    return "\n".join(parts)


def write_json(path: str, data: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, allow_nan=False, default=_nan_free)
        f.write("\n")


def _nan_free(value: Any) -> Any:
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
