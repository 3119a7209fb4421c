"""What a new user meets in the first hour (issue 33): LLM() and LLM.default() on the shipped
family, bench and eval without --model, generate's streaming / stats / labels / samples, help text
on every flag, the model folder as a positional argument, the server's start-up line, max_tokens
past the context refused, and MTP's default k of 1."""

from __future__ import annotations

import argparse
import io
import logging
import shutil
import sys

import pytest

from foretell import LLM, SamplingParams, cli, defaults
from foretell.cli_args import speculative_config_from_args
from foretell.engine.outputs import CompletionOutput


@pytest.fixture
def family(tmp_path, monkeypatch, qwen3_checkpoint, eagle3_head, qwen3_tied_checkpoint):
    """A stand-in default family built from the tiny test checkpoints (fast to load)."""
    root = tmp_path / "default_models"
    for member, source in (("target", qwen3_checkpoint), ("eagle3", eagle3_head),
                           ("draft_model", qwen3_tied_checkpoint)):
        shutil.copytree(source, root / defaults.MEMBERS[member])
    monkeypatch.setattr(defaults, "DEFAULT_MODELS_DIR", str(root))
    return root


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# ------------------------------------------------------------------ 3: LLM() and LLM.default()

def test_llm_without_a_model_is_the_shipped_family_with_its_eagle3_head():
    """The real shipped family: the target drafting with its EAGLE3 head at k=3, and greedy text
    equal to the target's alone."""
    llm = LLM(num_kv_blocks=32)
    config = llm.engine.config
    assert config.model.model == defaults.member_path("target")
    assert config.speculative.method == "eagle3"
    assert config.speculative.model == defaults.member_path("eagle3")
    assert config.speculative.num_speculative_tokens == 3
    prompt = "Question: Tom has 3 apples and buys 5 more. How many now?\nAnswer:"
    with_head = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0]
    assert llm.get_stats()["num_drafts"] > 0
    alone = LLM.default(method=None, num_kv_blocks=32)
    assert alone.engine.config.speculative is None
    assert alone.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids == with_head.token_ids


def test_llm_default_members(family):
    llm = LLM.default(method="draft_model", num_speculative_tokens=2, num_kv_blocks=16)
    spec = llm.engine.config.speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model", str(family / "qwen3-draft"), 2)
    assert LLM(speculative_config={"method": "ngram"}, num_kv_blocks=16).engine.config.speculative.method == "ngram"
    assert defaults.default_speculative_config("deepseek", "mtp") == {"method": "mtp", "num_speculative_tokens": 1}
    assert defaults.default_speculative_config("qwen3", "none") is None
    with pytest.raises(ValueError, match="needs the deepseek family"):
        LLM.default(method="mtp")
    with pytest.raises(ValueError, match="unknown default family 'llama'"):
        LLM.default(family="llama")


def test_llm_without_default_models_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "DEFAULT_MODELS_DIR", str(tmp_path / "none"))
    with pytest.raises(ValueError, match="no default model is installed"):
        LLM()


# ------------------------------------------------------------- 4: bench and eval without --model

def bench_args(*argv: str) -> argparse.Namespace:
    args = cli.build_parser().parse_args(["bench", *argv])
    from foretell.cli_args import take_model_positional

    take_model_positional(args)
    return args


def test_bench_without_model_sweeps_the_default_family(family):
    from foretell.bench.cli import build_bench_settings

    s = build_bench_settings(bench_args("--no-progress"))
    assert s.model == str(family / "qwen3-target")
    assert s.speculative_configs == [
        {"method": "eagle3", "num_speculative_tokens": 3, "model": str(family / "qwen3-eagle3")}]
    s = build_bench_settings(bench_args("--methods", "eagle3,draft_model,ngram", "--k", "1,2"))
    models = {(c["method"], c["num_speculative_tokens"]): c.get("model") for c in s.speculative_configs}
    assert models == {
        ("eagle3", 1): str(family / "qwen3-eagle3"), ("eagle3", 2): str(family / "qwen3-eagle3"),
        ("draft_model", 1): str(family / "qwen3-draft"), ("draft_model", 2): str(family / "qwen3-draft"),
        ("ngram", 1): None, ("ngram", 2): None,
    }
    s = build_bench_settings(bench_args("--method", "none"))
    assert s.speculative_configs == []


def test_bench_without_model_runs(family, capsys):
    rc = cli.main(["bench", "--no-progress", "--no-warmup", "--num-prompts", "1", "--max-tokens", "4",
                   "--num-kv-blocks", "64", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "qwen3-target" in out and "| eagle3 " in out and "| none " in out


def test_bench_model_as_first_argument(qwen3_checkpoint, tmp_path):
    from foretell.bench.cli import build_bench_settings

    args = bench_args(qwen3_checkpoint, "--methods", "ngram", "--k", "2", "--no-progress")
    assert args.bench_mode is None
    s = build_bench_settings(args)
    assert s.model == qwen3_checkpoint and s.speculative_configs[0]["num_speculative_tokens"] == 2
    args = bench_args("--methods", "ngram", qwen3_checkpoint, "--batch-sizes", "2")  # flags around it
    assert args.model == qwen3_checkpoint and args.batch_sizes == "2" and args.methods == "ngram"
    args = cli.build_parser().parse_args(["bench", "serve", "--base-url", "http://h:1"])
    assert args.bench_mode == "serve" and args.base_url == "http://h:1"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", qwen3_checkpoint, "--no-such-flag"])


def test_eval_without_model_uses_the_default_family(family, tmp_path):
    import json

    path = tmp_path / "eval.json"
    rc = cli.main(["eval", "gsm8k", "--device", "cpu", "--num-fewshot", "0", "--limit", "1",
                   "--max-tokens", "3", "--num-kv-blocks", "64", "--output-json", str(path),
                   "--no-progress"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["model"] == str(family / "qwen3-target")
    assert report["spec_decode"]["num_speculative_tokens"] == 3  # its EAGLE3 head


# ------------------------------------------------------------------------------------ 6: the CLI

def all_parsers(parser: argparse.ArgumentParser, name: str = "foretell"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action._name_parser_map.items():
                yield from all_parsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help():
    missing = []
    for name, parser in all_parsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [(name, a.dest) for a in action._choices_actions if not a.help]
                if name != "foretell" and not action.help:
                    missing.append((name, action.dest))
            elif not action.help or not action.help.strip():
                missing.append((name, action.option_strings or action.dest))
    assert not missing
    names = [name for name, _ in all_parsers(cli.build_parser())]
    assert {"foretell generate", "foretell serve", "foretell bench", "foretell bench serve",
            "foretell eval", "foretell train-eagle3"} <= set(names)


def test_serve_help_shows_default_host_and_port(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1;" in out and "(default: 8000)" in out
    assert "MODEL" in out


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["eval", "gsm8k"]])
def test_model_folder_as_positional_argument(command, tmp_path):
    from foretell.cli_args import take_model_positional

    parser = cli.build_parser()
    args = parser.parse_args([*command[:1], "DIR", *command[1:]] if command[0] != "eval"
                             else [*command, "DIR"])
    take_model_positional(args)
    assert args.model == "DIR"
    args = parser.parse_args([*command, "--model", "DIR"])
    take_model_positional(args)
    assert args.model == "DIR"
    args = parser.parse_args([*command, "DIR", "--model", "DIR"] if command[0] == "eval"
                             else [command[0], "DIR", *command[1:], "--model", "DIR"])
    take_model_positional(args)  # the same folder twice is fine
    assert args.model == "DIR"


def test_model_given_twice_differently_is_a_clear_error(qwen3_checkpoint, capsys):
    rc = cli.main(["generate", qwen3_checkpoint, "--model", "/somewhere/else", "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "the model is given twice" in err and "/somewhere/else" in err


class Recorder(io.StringIO):
    """stdout that keeps every write, and says it is not a terminal."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)

    def isatty(self) -> bool:
        return False


def run_cli(monkeypatch, argv) -> Recorder:
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(argv) == 0
    monkeypatch.undo()
    return out


def test_generate_streams_text_as_it_comes(qwen3_checkpoint, monkeypatch):
    base = ["generate", qwen3_checkpoint, "--prompt", "The cat", "--max-tokens", "10",
            "--ignore-eos", "--num-kv-blocks", "32"]
    streamed = run_cli(monkeypatch, [*base, "--stream", "on", "--stats"])
    at_end = run_cli(monkeypatch, [*base, "--stream", "off"])
    text = LLM(qwen3_checkpoint, num_kv_blocks=32).generate(
        "The cat", greedy(10), use_tqdm=False)[0].outputs[0].text
    assert f"The cat{text}\n" in streamed.getvalue() and f"The cat{text}\n" in at_end.getvalue()
    pieces = [w for w in streamed.writes if w and w in text]
    assert len(pieces) >= 5, streamed.writes  # written piece by piece, not at once
    assert "--- finish reason: length (--max-tokens 10 reached)" in streamed.getvalue()
    stats = streamed.getvalue()
    assert "--- 10 tokens in " in stats and " tokens/s (wall time" in stats
    assert '"wall_time_s"' in stats and '"tokens_per_s"' in stats and '"num_steps"' in stats
    # auto: stdout is no terminal here, so everything prints at the end in one piece
    auto = run_cli(monkeypatch, base)
    assert f"The cat{text}" in auto.writes


def test_streaming_never_shows_text_past_a_stop_string(qwen3_checkpoint, monkeypatch):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=32)
    full = llm.generate("The cat", greedy(12), use_tqdm=False)[0].outputs[0].text
    # a 2-letter stop string inside the output, past its first characters
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].isalpha())
    expected = llm.generate("The cat", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                        stop=[stop]), use_tqdm=False)[0].outputs[0].text
    out = run_cli(monkeypatch, ["generate", qwen3_checkpoint, "--prompt", "The cat", "--max-tokens",
                                "12", "--ignore-eos", "--num-kv-blocks", "32", "--stream", "on",
                                "--stop", stop])
    assert "".join(out.writes[2:]).startswith(f"The cat{expected}\n--- finish reason: stop (stop string {stop!r})")


def test_generate_labels_samples_of_n(qwen3_checkpoint, capsys):
    assert cli.main(["generate", qwen3_checkpoint, "--prompt", "The cat", "--max-tokens", "4",
                     "--n", "3", "--temperature", "1.0", "--sampling-seed", "1", "--ignore-eos",
                     "--num-kv-blocks", "32", "--stream", "on"]) == 0  # n > 1: printed at the end
    out = capsys.readouterr().out
    assert out.count("--- prompt: 'The cat'") == 1
    assert [line for line in out.splitlines() if line.startswith("[sample")] == [
        "[sample 0]", "[sample 1]", "[sample 2]"]
    assert out.count("--- finish reason: length (--max-tokens 4 reached)") == 3


def test_finish_reason_labels():
    params = SamplingParams(max_tokens=8)

    def label(reason, why=None, n=8):
        return cli.describe_finish(CompletionOutput(0, "", [1] * n, reason, why), params, {7})

    assert label("stop", "\n") == "stop (stop string '\\n')"
    assert label("stop", 7) == "stop (end-of-sequence token 7)"
    assert label("stop", 9) == "stop (stop token id 9)"
    assert label("length") == "length (--max-tokens 8 reached)"
    assert label("length", n=5) == "length (the model's context, --max-model-len, is full)"
    assert label("abort") == "abort"


def test_server_logs_what_it_loaded(qwen3_checkpoint, eagle3_head, caplog):
    from foretell.config import build_engine_config
    from foretell.server.launcher import engine_factory_that_logs

    config = build_engine_config(qwen3_checkpoint, num_kv_blocks=16, device="cpu", dtype="float32",
                                 speculative_config={"method": "eagle3", "model": eagle3_head,
                                                     "num_speculative_tokens": 2})
    with caplog.at_level(logging.INFO, logger="foretell.server"):
        engine = engine_factory_that_logs(config, "tiny")()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded model")]
    assert lines == [f"loaded model {qwen3_checkpoint} (served as 'tiny'), drafter: eagle3 "
                     f"{eagle3_head}, k=2, dtype float32, device cpu, max_model_len {engine.max_model_len}"]
    plain = build_engine_config(qwen3_checkpoint, num_kv_blocks=16, device="cpu")
    with caplog.at_level(logging.INFO, logger="foretell.server"):
        engine_factory_that_logs(plain, "tiny")()
    assert "drafter: no speculation, dtype float32, device cpu" in caplog.records[-1].getMessage()


# ---------------------------------------------------------- 7: max_tokens past the context; MTP k

def test_max_tokens_past_the_context_is_refused(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens is 10000000 and the prompt is 4 tokens") as e:
        llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, greedy(10_000_000), use_tqdm=False)
    assert "max_model_len 64" in str(e.value) and "at most 60" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="max_tokens is 61"):
        llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, greedy(61), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, greedy(60), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"  # exactly up to the end


def parse_spec(*argv: str) -> dict | None:
    return speculative_config_from_args(cli.build_parser().parse_args(["generate", "--prompt", "x", *argv]))


def test_mtp_defaults_to_one_draft_token():
    assert parse_spec("--method", "mtp") == {"method": "mtp", "num_speculative_tokens": 1}
    assert parse_spec("--method", "mtp", "--num-speculative-tokens", "2")["num_speculative_tokens"] == 2
    assert parse_spec("--speculative-config", '{"method": "mtp"}')["num_speculative_tokens"] == 1
    assert parse_spec("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')[
        "num_speculative_tokens"] == 3
    assert parse_spec("--method", "ngram")["num_speculative_tokens"] == 3
    assert parse_spec("--method", "none") is None and parse_spec() is None
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--default-family", "deepseek",
                                          "--method", "mtp"])
    assert defaults.default_num_speculative_tokens(args.method) == 1


def test_speculative_config_default_k_is_one_for_mtp_and_three_otherwise():
    from foretell.config import SpeculativeConfig

    assert SpeculativeConfig(method="mtp").num_speculative_tokens == 1
    assert SpeculativeConfig.from_any({"method": "mtp"}).num_speculative_tokens == 1
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == 3
    assert SpeculativeConfig(method="mtp", num_speculative_tokens=2).num_speculative_tokens == 2


def test_llm_close_frees_the_engine_at_once_and_refuses_to_generate_after():
    import gc
    import weakref

    from foretell import LLM, SamplingParams

    gc.collect()
    gc.disable()  # close() must free the engine itself, even when a reference cycle holds it
    try:
        with LLM(num_kv_blocks=16, speculative_config={"method": "ngram"}) as llm:
            out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=4), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
            engine = weakref.ref(llm.engine)
            model = weakref.ref(llm.engine.runner.model)
        assert engine() is None and model() is None
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate(["x"], SamplingParams(max_tokens=1))
        llm.close()  # twice is fine
    finally:
        gc.enable()
