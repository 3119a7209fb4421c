"""The model folders benchmark scripts run an EAGLE3 engine on, so that no script keeps its own
copy of "which checkpoint, which dtype, which device" nor borrows tests/ fixtures:

  published_config_folder(name)       a folder of foretell/configs (published config.json, no weights)
  eagle3_bench_models(tiny)           (target, head, engine options): Llama-3.1-8B and its EAGLE3
                                      head as dummy weights in bf16 on CUDA, or with tiny=True a
                                      tiny random Qwen3 and head (foretell.bench.tiny_checkpoints)
                                      in float32 on the CPU: the same script, as a smoke test
  synthetic_prompt(vocab_size, length)  a token-id prompt that needs no tokenizer

The engine options are keyword arguments of `LLM(...)`; a script adds its own (speculative_config,
max_num_seqs, ...) beside them.
"""

from __future__ import annotations

import os
import tempfile
from typing import NamedTuple

from foretell.bench.tiny_checkpoints import write_tiny_eagle3_head, write_tiny_qwen3

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
TINY_HEAD_DRAFT_VOCAB = 256  # of the tiny target's 512 ids
TINY_HEAD_AUX_LAYERS = [0, 1, 2]  # of the tiny target's 4 layers


class BenchModels(NamedTuple):
    """What `LLM(target, speculative_config={"model": head, ...}, **engine_options)` needs."""

    target: str  # folder of the target model
    head: str  # folder of an EAGLE3 head for it
    engine_options: dict  # dtype, device and (published shapes) load_format="dummy"


def published_config_folder(name: str) -> str:
    """The folder foretell/configs/<name> (a published config.json: load it with load_format="dummy")."""
    folder = os.path.join(CONFIGS_DIR, name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        names = sorted(n for n in os.listdir(CONFIGS_DIR) if os.path.isdir(os.path.join(CONFIGS_DIR, n)))
        raise ValueError(f"no published config {name!r} in {CONFIGS_DIR}; expected one of {names}")
    return folder


def eagle3_bench_models(tiny: bool, folder: str | None = None) -> BenchModels:
    """Llama-3.1-8B + its EAGLE3 head at their published shapes (dummy weights, bf16, CUDA), or
    with tiny=True a tiny random Qwen3 + EAGLE3 head written under folder (a new temporary folder
    when None) and run in float32 on the CPU."""
    if not tiny:
        return BenchModels(published_config_folder("llama-3.1-8b"), published_config_folder("llama-3.1-8b-eagle3"),
                           {"dtype": "bfloat16", "device": "cuda", "load_format": "dummy"})
    root = folder if folder is not None else tempfile.mkdtemp(prefix="foretell-bench-")
    target = write_tiny_qwen3(os.path.join(root, "target"))
    head = write_tiny_eagle3_head(os.path.join(root, "head"), target, draft_vocab_size=TINY_HEAD_DRAFT_VOCAB,
                                  aux_layer_ids=TINY_HEAD_AUX_LAYERS)
    return BenchModels(target, head, {"dtype": "float32", "device": "cpu"})


def synthetic_prompt(vocab_size: int, length: int) -> dict:
    """{"prompt_token_ids": [...]} of length ids in 1..min(vocab_size - 1, 1000), a fixed pattern
    (the same prompt on every model, away from id 0 and the top of the vocabulary)."""
    if vocab_size < 2 or length < 1:
        raise ValueError(f"synthetic_prompt needs vocab_size >= 2 and length >= 1, got {vocab_size} and {length}")
    span = min(vocab_size - 1, 1000)
    return {"prompt_token_ids": [(7 * j) % span + 1 for j in range(length)]}
