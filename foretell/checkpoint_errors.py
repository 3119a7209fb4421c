"""The error a checkpoint that does not fit its model raises (loader.py, checkpoint_fp8.py), and the
short lists of names its messages quote."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model; the message names the file and key."""


def list_names(items: list[str], limit: int = 20) -> str:
    """The first `limit` names, comma-separated, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
