"""The default model family that ships in foretell/default_models: what `foretell generate` and
`foretell serve` run when no --model is given (the Qwen3-layout target with its EAGLE3 head; the
flags --method draft_model / ngram / none pick the other drafters)."""

from __future__ import annotations

import argparse
import os

DEFAULT_MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_models")
MEMBERS = {"target": "qwen3-target", "eagle3": "qwen3-eagle3", "draft_model": "qwen3-draft"}
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


def member_path(name: str) -> str:
    return os.path.join(DEFAULT_MODELS_DIR, MEMBERS[name])


def fill_default_models(args: argparse.Namespace) -> None:
    """With no --model: the default target, and (unless told otherwise) its EAGLE3 head."""
    if args.model:
        return
    target = member_path("target")
    if not os.path.isdir(target):
        raise ValueError(
            f"no --model given and no default model is installed at {target}: pass --model DIR"
        )
    args.model = target
    if args.speculative_config is None and args.method is None:
        args.method = "eagle3"
    if args.method in ("eagle3", "draft_model") and not args.draft_model:
        args.draft_model = member_path(args.method)
    if args.method not in (None, "none") and args.num_speculative_tokens is None:
        args.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
