"""The shipped data's files and the Prompt record every dataset yields (datasets.py's loaders and
bench/repetitive.py's built set read them from here, so neither imports the other)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")

# Keys a JSONL prompt file may use, in the order they are looked for.
TEXT_KEYS = ("prompt", "text", "question", "instruction", "input")


@dataclass
class Prompt:
    text: str | None = None
    token_ids: list[int] | None = None
    source: str = ""  # where it came from: "gsm8k:12", "file.jsonl:3", ...


def data_path(name: str) -> str:
    """Absolute path of a file shipped in foretell/data."""
    path = os.path.join(DATA_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: the package data was not installed (reinstall foretell)"
        )
    return path


def read_jsonl(path: str) -> list[dict]:
    """Objects of a JSON Lines file; blank lines are skipped, bad lines raise with their number."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from e
    return records
