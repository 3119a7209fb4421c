"""Speculative decoding's acceptance from a server's Prometheus counters: the `<prefix>:spec_decode_*`
counters (foretell's and vLLM's names) parsed from a /metrics exposition, and their change over a
run turned into acceptance figures (foretell bench serve reads them before and after its load).
"""

from __future__ import annotations

import re
from typing import Any

from foretell.bench.report import acceptance_counters

SPEC_METRIC = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*:)?spec_decode_"
    r"(num_drafts|num_draft_tokens|num_accepted_tokens_per_pos|num_accepted_tokens)(?:_total)?$"
)
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_spec_metrics(text: str) -> dict[str, Any] | None:
    """The spec_decode counters in a Prometheus exposition (summed over labels other than
    position), or None when there are none."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, labels, value = _split_sample(line)
        if name is None:
            continue
        m = SPEC_METRIC.match(name)
        if not m:
            continue
        kind = m.group(1)
        if kind == "num_accepted_tokens_per_pos":
            try:
                pos = int(labels.get("position", ""))
            except ValueError:
                continue
            per_position[pos] = per_position.get(pos, 0.0) + value
        else:
            totals[kind] = totals.get(kind, 0.0) + value
    if not totals and not per_position:
        return None
    return {"totals": totals, "per_position": per_position}


def _split_sample(line: str) -> tuple[str | None, dict[str, str], float]:
    if "{" in line:
        name, rest = line.split("{", 1)
        label_text, _, rest = rest.rpartition("}")
        labels = dict(LABEL.findall(label_text))
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    fields_ = rest.split()
    try:
        return name.strip(), labels, float(fields_[0])
    except (IndexError, ValueError):
        return None, {}, 0.0


def spec_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    if after is None:
        return None
    before = before or {"totals": {}, "per_position": {}}
    def d(kind):
        return after["totals"].get(kind, 0.0) - before["totals"].get(kind, 0.0)
    drafts, draft_tokens = d("num_drafts"), d("num_draft_tokens")
    accepted = d("num_accepted_tokens")
    positions = sorted(after["per_position"])
    per_pos = [after["per_position"][p] - before["per_position"].get(p, 0.0) for p in positions]
    return acceptance_counters(drafts, draft_tokens, accepted, per_pos)


# ---- requests ---------------------------------------------------------------------------------
