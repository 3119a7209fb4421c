"""PNG plots of a sweep report: acceptance per position, tokens/s and speedup against k, and the
measured speedup against the predicted one. Uses matplotlib's object API with the Agg canvas, so
it neither needs a display nor touches pyplot's global state."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

PLOT_FILES = (
    "acceptance_per_position.png",
    "tokens_per_s_vs_k.png",
    "speedup_vs_k.png",
    "speedup_measured_vs_predicted.png",
)


def _figure(ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * ncols, 4.0), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _method_colors(report: dict[str, Any]) -> dict[str, str]:
    """One colour per method, the same in every plot."""
    methods = sorted({r["method"] for r in report["results"] if r["k"]})
    return {m: f"C{i}" for i, m in enumerate(methods)}


def _spec_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["results"] if r["k"]]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def acceptance_figure(report: dict[str, Any]):
    """One line per (method, k), each with its own colour and marker (k=1 and k=3 of one method
    must not look alike)."""
    # Acceptance does not depend on the batch size: pool the counts of all batch sizes.
    pooled: dict[tuple[str, int], list[int]] = {}
    drafts: dict[tuple[str, int], int] = defaultdict(int)
    for r in _spec_rows(report):
        key = (r["method"], r["k"])
        counts = pooled.setdefault(key, [0] * r["k"])
        pooled[key] = [a + b for a, b in zip(counts, r["accepted_per_position"])]
        drafts[key] += r["num_drafts"]
    fig, (ax,) = _figure()
    for i, ((method, k), counts) in enumerate(sorted(pooled.items())):
        rates = [c / drafts[(method, k)] if drafts[(method, k)] else 0.0 for c in counts]
        ax.plot(range(1, k + 1), rates, marker=MARKERS[i % len(MARKERS)], color=f"C{i % 10}",
                label=f"{method} k={k}")
    ax.set(xlabel="draft position", ylabel="acceptance (accepted / drafts)", ylim=(0, 1.05),
           title="Acceptance per position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if pooled:
        ax.legend(fontsize="small")
    return fig


def plot_acceptance(report: dict[str, Any], path: str) -> None:
    acceptance_figure(report).savefig(path, dpi=110)


def _against_k(report: dict[str, Any], path: str, field: str, ylabel: str, title: str) -> None:
    batch_sizes = report["batch_sizes"]
    colors = _method_colors(report)
    fig, axes = _figure(len(batch_sizes))
    for ax, bs in zip(axes, batch_sizes):
        rows = [r for r in report["results"] if r["batch_size"] == bs]
        by_method: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if r["k"] and r.get(field) is not None:
                by_method[r["method"]].append((r["k"], r[field]))
        for method, points in sorted(by_method.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    color=colors[method], label=method)
        base = next((r for r in rows if not r["k"]), None)
        if base is not None and base.get(field) is not None:
            ax.axhline(base[field], color="gray", linestyle="--", label="no speculation")
        ax.set(xlabel="k (num_speculative_tokens)", ylabel=ylabel, title=f"{title}, batch {bs}")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


PREDICTION_NOTE = (
    "acceptance model: L / (1 + k c), L = mean acceptance length,\n"
    "  k c = draft step time / verify step time\n"
    "step model: tokens per step x decode step / (verify + draft step)"
)


def predicted_figure(report: dict[str, Any]):
    fig, (ax,) = _figure()
    rows = [r for r in _spec_rows(report) if r.get("speedup") is not None]
    top = 1.0
    colors = _method_colors(report)
    for r in rows:
        color = colors[r["method"]]
        for key, marker, filled in (("predicted_speedup", "o", True),
                                    ("predicted_speedup_step_model", "s", False)):
            x = r.get(key)
            if x is None:
                continue
            ax.scatter(x, r["speedup"], marker=marker, color=color if filled else "none",
                       edgecolors=color)
            top = max(top, x, r["speedup"])
    for method in sorted({r["method"] for r in rows}):
        color = colors[method]
        ax.scatter([], [], marker="o", color=color, label=f"{method}: acceptance model")
        ax.scatter([], [], marker="s", color="none", edgecolors=color,
                   label=f"{method}: step model")
    ax.plot([0, top * 1.1], [0, top * 1.1], color="gray", linestyle="--",
            label="measured = predicted")
    ax.set(xlabel="predicted speedup", ylabel="measured speedup", xlim=(0, top * 1.1),
           ylim=(0, top * 1.1), title="Measured vs predicted speedup")
    ax.legend(fontsize="x-small")
    fig.supxlabel(PREDICTION_NOTE, fontsize="x-small", ha="left", x=0.02)
    return fig


def plot_predicted(report: dict[str, Any], path: str) -> None:
    predicted_figure(report).savefig(path, dpi=110)


def write_plots(report: dict[str, Any], plot_dir: str) -> list[str]:
    os.makedirs(plot_dir, exist_ok=True)
    paths = [os.path.join(plot_dir, name) for name in PLOT_FILES]
    plot_acceptance(report, paths[0])
    _against_k(report, paths[1], "tokens_per_s", "tokens/s", "Throughput")
    _against_k(report, paths[2], "speedup", "speedup over no speculation", "Speedup")
    plot_predicted(report, paths[3])
    return paths
