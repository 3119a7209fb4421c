"""train-eagle3 --regenerate shows progress while the samples run (tokens against their budget,
the finished samples beside it), and --no-progress silences every bar (issue 33, item 8)."""

from __future__ import annotations

import json

from foretell import LLM, SamplingParams
from foretell.cli import build_parser, main
from foretell.training.regenerate import RegenerateOptions, generate, run_with_progress

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]


def test_run_with_progress_matches_generate_and_counts_samples(qwen3_checkpoint, capsys):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=64, max_num_seqs=2)  # two at a time: finishes spread out
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 7)]
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    capsys.readouterr()
    outputs = run_with_progress(llm.engine, PROMPTS, params, progress=True, redraw_interval_s=0.0)
    assert outputs == expected and [len(o) for o in outputs] == [3, 9, 5, 7]
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "regenerate: 100%" in err and "24/24" in err and "4/4 samples done" in err
    # two sequences at a time: the first pair's steps show before any sample is done
    assert any("0/4 samples done" in line and " 0/24" not in line for line in err.splitlines())
    assert not llm.engine.has_unfinished_requests()


def test_no_progress_prints_no_bar(qwen3_checkpoint, capsys):
    options = RegenerateOptions(max_tokens=4, device="cpu", progress=False)
    outputs = generate(qwen3_checkpoint, PROMPTS[:2], options, max_len=64)
    assert all(1 <= len(o) <= 4 for o in outputs)  # 4, or fewer at an EOS
    assert "regenerate" not in capsys.readouterr().err


def test_train_eagle3_no_progress_reaches_regeneration(tmp_path):
    args = build_parser().parse_args(["train-eagle3", "--target", "T", "--data", "D", "--out", "O",
                                      "--regenerate", "--no-progress"])
    from foretell.training.cli import config_from_args

    assert config_from_args(args).progress is False


def test_train_eagle3_regenerate_cli_is_quiet_with_no_progress(qwen3_checkpoint, tmp_path, capfd):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"The cat {i}"}) + "\n" for i in range(6)))
    rc = main(["train-eagle3", "--target", qwen3_checkpoint, "--data", str(data), "--out",
               str(tmp_path / "head"), "--regenerate", "--regen-max-tokens", "4", "--max-steps", "1",
               "--batch-size", "2", "--draft-vocab-size", "64", "--ttt-steps", "1", "--max-len", "64",
               "--eval-fraction", "0", "--device", "cpu", "--no-progress"])
    assert rc == 0
    err = capfd.readouterr().err
    assert "%|" not in err, err  # no bar at all (tqdm draws "NN%|")
    assert (tmp_path / "head" / "regenerated.jsonl").exists()
