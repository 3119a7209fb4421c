"""foretell eval gsm8k: answer extraction and scoring on hand-made cases, prompt building, and the
command end to end on a tiny checkpoint (with and without speculation)."""

from __future__ import annotations

import json
import math

import pytest

from foretell.bench.datasets import data_path, read_jsonl
from foretell.cli import main
from foretell.eval import gsm8k


@pytest.mark.parametrize("text, expected", [
    ("72", "72"), ("1,234", "1234"), ("$5", "5"), ("5.00", "5"), ("0.50", "0.5"), ("-3", "-3"),
    ("18.", "18"), (" 7 ", "7"), ("1,450,000", "1450000"), ("abc", None), ("", None), (None, None),
])
def test_normalize_number(text, expected):
    assert gsm8k.normalize_number(text) == expected


@pytest.mark.parametrize("completion, strict, flexible", [
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72", "72"),
    ("She earns $1,000 a week.\n#### $1,000", "1000", "1000"),
    ("#### -10", "-10", "-10"),
    ("#### 3.50 dollars", "3.5", "3.5"),
    ("#### 3 and then #### 4", "3", "4"),  # strict takes the first ####, flexible the last number
    ("He has 12 apples and buys 7 more, so 19.", None, "19"),
    ("The total is $2.25.", None, "2.25"),
    ("no numbers at all", None, None),
    ("", None, None),
    ("####", None, None),
])
def test_extract_answers(completion, strict, flexible):
    assert gsm8k.extract_strict(completion) == strict
    assert gsm8k.extract_flexible(completion) == flexible


def test_every_reference_answer_parses():
    for record in read_jsonl(data_path("gsm8k_test.jsonl")):
        assert gsm8k.reference_answer(record["answer"]) is not None
    with pytest.raises(ValueError, match="without a '#### <number>'"):
        gsm8k.reference_answer("no final line")


def test_score_and_standard_error():
    completions = ["x\n#### 18", "y\n#### 4.0", "z is 7", "#### 1", "nothing"]
    references = ["18", "4", "7", "2", "5"]
    s = gsm8k.score(completions, references)
    assert (s["strict_correct"], s["flexible_correct"]) == (2, 3)
    assert s["strict_match"] == pytest.approx(0.4)
    assert s["strict_match_stderr"] == pytest.approx(math.sqrt(0.4 * 0.6 / 4))
    assert s["flexible_match"] == pytest.approx(0.6)
    assert s["num_without_hash_answer"] == 2
    assert [x["strict_correct"] for x in s["samples"]] == [True, True, False, False, False]
    assert gsm8k.accuracy([True]) == (1.0, None)
    assert gsm8k.accuracy([]) == (0.0, None)


def test_fewshot_prompt():
    train = read_jsonl(data_path("gsm8k_train.jsonl"))
    shots = gsm8k.fewshot_examples(train, 2, seed=1234)
    assert shots == gsm8k.fewshot_examples(train, 2, seed=1234)
    assert shots != gsm8k.fewshot_examples(train, 2, seed=1)
    prompt = gsm8k.build_prompt(shots, "What is 2 + 2?")
    assert prompt.count("Question: ") == 3 and prompt.count("####") == 2
    assert prompt.startswith(f"Question: {shots[0]['question']}\nAnswer: {shots[0]['answer']}\n\n")
    assert prompt.endswith("Question: What is 2 + 2?\nAnswer:")
    assert gsm8k.build_prompt([], "q") == "Question: q\nAnswer:"
    with pytest.raises(ValueError, match="num-fewshot"):
        gsm8k.fewshot_examples(train, -1, seed=0)


def test_eval_with_speculation_end_to_end(qwen3_checkpoint, tmp_path, capsys):
    path = tmp_path / "eval.json"
    rc = main([
        "eval", "gsm8k", "--model", qwen3_checkpoint, "--device", "cpu", "--method", "draft_model",
        "--draft-model", qwen3_checkpoint, "--num-speculative-tokens", "2",
        "--num-fewshot", "1", "--limit", "2", "--max-tokens", "6",
        "--output-json", str(path), "--log-samples", "--no-progress",
    ])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["num_questions"] == 2 and report["num_fewshot"] == 1
    for key in ("strict_match", "strict_match_stderr", "flexible_match", "flexible_match_stderr",
                "tokens_per_s", "generated_tokens"):
        assert key in report
    spec = report["spec_decode"]
    assert spec["num_speculative_tokens"] == 2 and spec["num_drafts"] > 0
    assert spec["acceptance_rate"] == 1.0  # the draft is the target
    assert spec["num_accepted_tokens"] == sum(spec["accepted_per_position"])
    check = report["greedy_check"]
    assert check["accuracy_identical"] and check["outputs_identical"]
    assert check["num_identical_outputs"] == 2
    assert len(report["samples"]) == 2
    sample = report["samples"][0]
    assert {"question", "completion", "reference", "strict", "flexible"} <= set(sample)
    assert report["samples"][0]["reference"] == "18"  # the first test question's answer
    out = capsys.readouterr().out
    assert "greedy accuracy identical" in out and "mean acceptance length" in out


def test_eval_without_speculation(qwen3_checkpoint, tmp_path):
    path = tmp_path / "eval.json"
    rc = main(["eval", "gsm8k", "--model", qwen3_checkpoint, "--device", "cpu",
               "--num-fewshot", "0", "--limit", "2",
               "--max-tokens", "3", "--output-json", str(path), "--no-progress"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["spec_decode"] is None and report["greedy_check"] is None
    assert "samples" not in report


def test_eval_errors(qwen3_checkpoint, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "mmlu", "--model", qwen3_checkpoint])
    assert main(["eval", "gsm8k", "--model", qwen3_checkpoint, "--limit", "0"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
