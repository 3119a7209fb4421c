"""ParallelConfig (vLLM's names): validation, the LLM keyword and the CLI flags reaching it, and
several ranks reaching the engine's config (tests/distributed/test_tp_engine.py runs them)."""

from __future__ import annotations

import argparse

import pytest

from foretell.cli_args import add_engine_args, engine_kwargs_from_args
from foretell.config import ParallelConfig, build_engine_config


def test_defaults_and_validation():
    assert ParallelConfig() == ParallelConfig(tensor_parallel_size=1, enable_expert_parallel=False)
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer >= 1, got"):
            ParallelConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False, got 'yes'"):
        ParallelConfig(enable_expert_parallel="yes")


def parse(*flags: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs_from_args(parser.parse_args(["--model", "m", *flags]))


def test_cli_flags_reach_the_config(tmp_path):
    model = str(tmp_path)  # an existing folder: no Hub look-up
    config = build_engine_config(model, **parse())
    assert config.parallel == ParallelConfig()
    config = build_engine_config(model, **parse("--tensor-parallel-size", "1", "--enable-expert-parallel"))
    assert config.parallel == ParallelConfig(1, True)
    assert parse("-tp", "4")["tensor_parallel_size"] == 4
    assert build_engine_config(model, tensor_parallel_size=1).parallel.tensor_parallel_size == 1


@pytest.mark.parametrize("how", ["keyword", "cli"])
def test_several_ranks_reach_the_config(tmp_path, how):
    kwargs = {"tensor_parallel_size": 2} if how == "keyword" else parse("-tp", "2", "--enable-expert-parallel")
    config = build_engine_config(str(tmp_path), **kwargs)
    assert config.parallel == ParallelConfig(2, how == "cli")
