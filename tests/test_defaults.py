"""`foretell generate` without --model runs the default family: the target with its EAGLE3 head,
or the member a flag picks."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from foretell import cli, defaults


@pytest.fixture
def family(tmp_path, monkeypatch, qwen3_checkpoint, eagle3_head, qwen3_tied_checkpoint):
    root = tmp_path / "default_models"
    for member, source in (("target", qwen3_checkpoint), ("eagle3", eagle3_head),
                           ("draft_model", qwen3_tied_checkpoint)):
        shutil.copytree(source, root / defaults.MEMBERS[member])
    monkeypatch.setattr(defaults, "DEFAULT_MODELS_DIR", str(root))
    return root


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["generate", "--prompt", "x", *argv])


def test_defaults_pick_the_target_and_its_head(family):
    args = parse()
    defaults.fill_default_models(args)
    assert args.model == str(family / "qwen3-target")
    assert args.method == "eagle3" and args.draft_model == str(family / "qwen3-eagle3")
    args = parse("--method", "draft_model")
    defaults.fill_default_models(args)
    assert args.draft_model == str(family / "qwen3-draft")
    args = parse("--method", "none")
    defaults.fill_default_models(args)
    from foretell.cli_args import speculative_config_from_args

    assert speculative_config_from_args(args) is None


def test_default_family_flag_picks_the_deepseek_members(family):
    shutil.copytree(family / "qwen3-target", family / "deepseek-target")  # stand-ins: only paths matter
    shutil.copytree(family / "qwen3-eagle3", family / "deepseek-eagle3")
    args = parse("--default-family", "deepseek")
    defaults.fill_default_models(args)
    assert args.model == str(family / "deepseek-target") and args.draft_model == str(family / "deepseek-eagle3")
    args = parse("--default-family", "deepseek", "--method", "mtp")
    defaults.fill_default_models(args)
    assert args.method == "mtp" and args.draft_model is None and args.num_speculative_tokens == 1
    args = parse("--default-family", "deepseek", "--method", "draft_model")  # the shared-tokenizer draft LM
    defaults.fill_default_models(args)
    assert args.draft_model == str(family / "qwen3-draft")


def test_generate_without_model_runs_end_to_end(family, capsys):
    assert cli.main(["generate", "--prompt", "The cat", "--max-tokens", "6",
                     "--num-kv-blocks", "32", "--stats"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt: 'The cat'" in out and '"num_drafts"' in out


def test_serve_without_model_names_the_member(family):
    """`foretell serve` with no --model: clients name the model "deepseek-target", not a path."""
    args = argparse.Namespace(model=None, speculative_config=None, method=None, draft_model=None,
                              num_speculative_tokens=None, default_family="deepseek", served_model_name=None)
    shutil.copytree(family / "qwen3-target", family / "deepseek-target")
    shutil.copytree(family / "qwen3-eagle3", family / "deepseek-eagle3")
    defaults.fill_default_models(args)
    assert args.served_model_name == "deepseek-target"
    args = argparse.Namespace(model=None, speculative_config=None, method=None, draft_model=None,
                              num_speculative_tokens=None, default_family="qwen3", served_model_name="mine")
    defaults.fill_default_models(args)
    assert args.served_model_name == "mine"


def test_missing_default_models_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "DEFAULT_MODELS_DIR", str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="no model given and no default model is installed"):
        defaults.fill_default_models(parse())
