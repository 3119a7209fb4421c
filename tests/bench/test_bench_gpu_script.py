"""CPU smoke test of scripts/bench_gpu.py (the lead's H200 benchmark driver): it imports without a
GPU, rejects unknown sections before touching CUDA, and its measuring functions (decode rate from
the requests' timestamps, the synchronous engine, speculation's agreement with plain greedy) run
on a tiny CPU engine through the public probes."""

from __future__ import annotations

import importlib.util
import os

import pytest

from foretell import LLM
from foretell.bench.tiny_checkpoints import write_tiny_eagle3_head, write_tiny_qwen3

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_gpu.py")


@pytest.fixture(scope="module")
def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def eagle3_llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_qwen3(str(root / "qwen3"))
    head = write_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    with LLM(target, device="cpu", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, max_num_seqs=4,
             speculative_config=spec, log_stats_interval_s=0) as llm:
        yield llm


def test_unknown_section_is_refused_before_cuda(bench_gpu, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_gpu.py", str(tmp_path / "out"), "--only", "llama_baseline,warp"])
    with pytest.raises(SystemExit) as exit_info:
        bench_gpu.main()
    assert exit_info.value.code == 2
    assert "unknown sections ['warp']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_decode_rates_on_a_tiny_engine(bench_gpu, eagle3_llm):
    row = bench_gpu.decode_tok_s(eagle3_llm, 2, prompt_len=16, new_tokens=8)
    assert row["batch"] == 2 and row["tok_s"] > 0 and row["ms_per_step"] > 0
    assert 1.0 <= row["mean_acceptance_length"] <= 3.0  # k = 2
    assert row["steps"] >= 8 / 3  # at most k + 1 tokens a step
    sync = bench_gpu.decode_sync_tok_s(eagle3_llm, 1, prompt_len=16, new_tokens=8)
    assert sync["batch"] == 1 and sync["tok_s"] > 0


def test_speculation_agreement_on_the_cpu(bench_gpu):
    out = bench_gpu.speculation_agreement("cpu", ("float32",), num_prompts=2, max_tokens=8)
    assert out == {"float32_eagle3_match_fraction": 1.0, "float32_draft_model_match_fraction": 1.0,
                   "float32_ngram_match_fraction": 1.0}
