"""The default model family that ships in foretell/default_models: what `foretell generate` and
`foretell serve` run when no --model is given (the Qwen3-layout target with its EAGLE3 head; the
flags --method draft_model / ngram / none pick the other drafters, --default-family deepseek the
DeepSeek-V3-layout target, whose drafters are its EAGLE3 head, its MTP layer (--method mtp), the
shared-tokenizer draft model and n-gram)."""

from __future__ import annotations

import argparse
import os

DEFAULT_MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_models")
FAMILIES = {
    "qwen3": {"target": "qwen3-target", "eagle3": "qwen3-eagle3", "draft_model": "qwen3-draft"},
    "deepseek": {"target": "deepseek-target", "eagle3": "deepseek-eagle3", "draft_model": "qwen3-draft"},
}
MEMBERS = FAMILIES["qwen3"]
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


def member_path(name: str, family: str = "qwen3") -> str:
    return os.path.join(DEFAULT_MODELS_DIR, FAMILIES[family][name])


def fill_default_models(args: argparse.Namespace) -> None:
    """With no --model: the default target, and (unless told otherwise) its EAGLE3 head."""
    if args.model:
        return
    family = getattr(args, "default_family", "qwen3")
    target = member_path("target", family)
    if not os.path.isdir(target):
        raise ValueError(
            f"no --model given and no default model is installed at {target}: pass --model DIR"
        )
    args.model = target
    if hasattr(args, "served_model_name") and not args.served_model_name:  # `foretell serve`
        args.served_model_name = FAMILIES[family]["target"]  # clients say "qwen3-target", not a path
    if args.speculative_config is None and args.method is None:
        args.method = "eagle3"
    if args.method in ("eagle3", "draft_model") and not args.draft_model:
        args.draft_model = member_path(args.method, family)
    if args.method not in (None, "none") and args.num_speculative_tokens is None:
        args.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
