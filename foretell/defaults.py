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
# MTP drafts with the target's own next-token layer, trained to predict one token ahead: reused
# for a second draft its acceptance falls quickly (README, "MLA + MoE targets and MTP"), so k=1.
# Suffix decoding drafts as many tokens as its match justifies, up to k (vLLM suggests 16 to 32).
NUM_SPECULATIVE_TOKENS_BY_METHOD = {"mtp": 1, "suffix": 16}


def default_num_speculative_tokens(method: str | None) -> int:
    """k when neither --num-speculative-tokens nor the speculative config gives one."""
    return NUM_SPECULATIVE_TOKENS_BY_METHOD.get(method, DEFAULT_NUM_SPECULATIVE_TOKENS)


def member_path(name: str, family: str = "qwen3") -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown default family {family!r}; choose from {', '.join(FAMILIES)}")
    return os.path.join(DEFAULT_MODELS_DIR, FAMILIES[family][name])


def default_target(family: str = "qwen3") -> str:
    """The family's target folder; a clear error when the default models are not installed."""
    target = member_path("target", family)
    if not os.path.isdir(target):
        raise ValueError(
            f"no model given and no default model is installed at {target}: pass a model "
            f"folder (--model DIR, or LLM(model=DIR))"
        )
    return target


def default_speculative_config(family: str = "qwen3", method: str | None = "eagle3",
                               num_speculative_tokens: int | None = None) -> dict | None:
    """The speculative_config of a default-family member: method eagle3 / draft_model take the
    family's head or draft LM, mtp the target's own layers, ngram nothing; None / "none": off."""
    if method in (None, "none"):
        return None
    config: dict = {"method": method,
                    "num_speculative_tokens": num_speculative_tokens or default_num_speculative_tokens(method)}
    if method in ("eagle3", "draft_model"):
        config["model"] = member_path(method, family)
    return config


def fill_default_models(args: argparse.Namespace) -> None:
    """With no --model: the default target, and (unless told otherwise) its EAGLE3 head."""
    if args.model:
        return
    family = getattr(args, "default_family", "qwen3")
    args.model = default_target(family)
    if hasattr(args, "served_model_name") and not args.served_model_name:  # `foretell serve`
        args.served_model_name = FAMILIES[family]["target"]  # clients say "qwen3-target", not a path
    if args.speculative_config is None and args.method is None:
        args.method = "eagle3"
    if args.method in ("eagle3", "draft_model") and not args.draft_model:
        args.draft_model = member_path(args.method, family)
    if args.method not in (None, "none") and args.num_speculative_tokens is None:
        args.num_speculative_tokens = default_num_speculative_tokens(args.method)
