"""The CLI's generate command end to end, and incremental detokenization across multi-byte
characters."""

from __future__ import annotations

import subprocess
import sys

from foretell.sampling_params import SamplingParams
from foretell.tokenizer import IncrementalDetokenizer, Tokenizer


def test_generate_cli(qwen3_checkpoint, eagle3_head):
    cmd = [sys.executable, "-m", "foretell.cli", "generate", "--model", qwen3_checkpoint,
           "--prompt", "The cat", "--prompt", "def add(x):", "--max-tokens", "8", "--num-kv-blocks", "32",
           "--method", "eagle3", "--draft-model", eagle3_head, "--num-speculative-tokens", "2", "--stats"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("--- prompt:") == 2 and '"num_drafts"' in out.stdout


def test_generate_cli_bad_input_is_a_clear_error(qwen3_checkpoint, tmp_path):
    cmd = [sys.executable, "-m", "foretell.cli", "generate", "--model", str(tmp_path), "--prompt", "x"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "config.json" in out.stderr


def test_incremental_detokenization_never_splits_characters(qwen3_checkpoint):
    tokenizer = Tokenizer(qwen3_checkpoint)
    text = "héllo wörld 🙂 ünïcode ✓ done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 2  # the tiny BPE splits these characters into byte tokens
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    pieces = []
    for token in ids:
        before = detok.text
        detok.add([token])
        pieces.append(detok.text[len(before):])
        assert "\ufffd" not in detok.text
    assert detok.text == tokenizer.decode(ids) == text
    assert "".join(pieces) == text


def test_stop_string_spanning_tokens(qwen3_checkpoint):
    tokenizer = Tokenizer(qwen3_checkpoint)
    ids = tokenizer.encode("the cat reads the book. the dog")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["book."]))
    hit = None
    for token in ids:
        hit, taken = detok.add([token])
        assert taken == 1
        if hit:
            break
    assert hit == "book." and detok.text == "the cat reads the "


def test_stop_string_inside_a_run_of_tokens_takes_only_those_before_it(qwen3_checkpoint):
    """A verify step hands several tokens at once: only those up to the stop are taken."""
    tokenizer = Tokenizer(qwen3_checkpoint)
    ids = tokenizer.encode("the cat reads the book. the dog runs")
    one_by_one = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["book."]))
    for n, token in enumerate(ids, start=1):
        if one_by_one.add([token])[0]:
            break
    at_once = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["book."]))
    hit, taken = at_once.add(ids)
    assert hit == "book." and taken == n < len(ids)
    assert at_once.text == one_by_one.text == "the cat reads the "
