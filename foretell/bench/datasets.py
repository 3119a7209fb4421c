"""Prompt sets for benchmarks: the data shipped in foretell/data, random token prompts, or a JSONL
file of the user's.

A prompt is text or token ids (random prompts are token ids, so their length is exact). Loading
never needs a tokenizer except for `random`, which needs the vocabulary to draw from.
"""

from __future__ import annotations

import os
import random
from typing import Callable, Iterable

from foretell.bench.prompt_files import DATA_DIR, TEXT_KEYS, Prompt, data_path, read_jsonl  # noqa: F401 (re-exported)


def _gsm8k(records: list[dict]) -> list[Prompt]:
    return [
        Prompt(text=f"Question: {r['question']}\nAnswer:", source=f"gsm8k:{i}")
        for i, r in enumerate(records)
    ]


def gsm8k_test_prompts(count: int) -> list[str]:
    """The first `count` GSM8K test questions as "Question: ...\nAnswer:" prompts."""
    return [p.text for p in _gsm8k(read_jsonl(data_path("gsm8k_test.jsonl"))[:count])]


def _mt_bench(records: list[dict]) -> list[Prompt]:
    # The first turn only: the second turn needs the model's answer to the first.
    return [Prompt(text=r["turns"][0], source=f"mt_bench:{r['question_id']}") for r in records]


def _humaneval(records: list[dict]) -> list[Prompt]:
    return [Prompt(text=r["prompt"], source=r["task_id"]) for r in records]


SHIPPED: dict[str, tuple[str, Callable[[list[dict]], list[Prompt]]]] = {
    "gsm8k": ("gsm8k_test.jsonl", _gsm8k),
    "mt_bench": ("mt_bench.jsonl", _mt_bench),
    "humaneval": ("humaneval.jsonl", _humaneval),
}
# Built from the shipped data by bench/repetitive.py (answers that repeat what came before).
BUILT = ("repetitive",)
DATASET_NAMES = tuple(sorted(SHIPPED)) + BUILT + ("random",)


def prompt_from_record(record, where: str) -> Prompt:
    """One line of a user's JSONL file: a string, or an object with prompt_token_ids, one of
    TEXT_KEYS, or `turns` (the first turn is used)."""
    if isinstance(record, str):
        text = record
    elif isinstance(record, dict):
        ids = record.get("prompt_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of integers")
            return Prompt(token_ids=ids, source=where)
        text = next((record[k] for k in TEXT_KEYS if k in record), None)
        if text is None and isinstance(record.get("turns"), list) and record["turns"]:
            text = record["turns"][0]
        if text is None:
            raise ValueError(
                f"{where}: found none of the keys prompt_token_ids, {', '.join(TEXT_KEYS)}, turns "
                f"(keys present: {sorted(record)})"
            )
    else:
        raise ValueError(f"{where}: expected a JSON string or object, got {type(record).__name__}")
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: the prompt must be a non-empty string")
    return Prompt(text=text, source=where)


def load_file(path: str) -> list[Prompt]:
    prompts = [
        prompt_from_record(r, f"{path}, record {i + 1}") for i, r in enumerate(read_jsonl(path))
    ]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts (it is empty or only blank lines)")
    return prompts


def ordinary_vocab(tokenizer) -> list[int]:
    """Token ids of a foretell Tokenizer that are not special (nor EOS)."""
    special = set(getattr(tokenizer.hf, "all_special_ids", None) or [])
    special |= set(tokenizer.eos_token_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def random_prompts(
    num_prompts: int, input_len: int, vocab: Iterable[int], seed: int
) -> list[Prompt]:
    """Prompts of exactly input_len token ids drawn uniformly from vocab (no special tokens)."""
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1 for the random dataset, got {input_len}")
    choices = list(vocab)
    if not choices:
        raise ValueError("the tokenizer has no ordinary tokens to draw random prompts from")
    rng = random.Random(seed)
    return [
        Prompt(token_ids=[rng.choice(choices) for _ in range(input_len)], source=f"random:{i}")
        for i in range(num_prompts)
    ]


def load_prompts(
    dataset: str,
    num_prompts: int | None = None,
    seed: int = 0,
    input_len: int = 128,
    vocab: Iterable[int] | None = None,
) -> list[Prompt]:
    """num_prompts prompts of a shipped dataset (a seeded sample, so runs are comparable), of
    `random`, or of a JSONL file (the first num_prompts, in file order). None: all of them
    (random needs a number)."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if dataset == "random":
        if vocab is None:
            raise ValueError("the random dataset needs a tokenizer vocabulary")
        return random_prompts(num_prompts or 16, input_len, vocab, seed)
    if dataset == "repetitive":  # in order: its re-asked questions come back later in the set
        from foretell.bench.repetitive import repetitive_prompts

        return repetitive_prompts(num_prompts or 32, seed)
    if dataset in SHIPPED:
        filename, convert = SHIPPED[dataset]
        prompts = convert(read_jsonl(data_path(filename)))
        if num_prompts is not None and num_prompts < len(prompts):
            prompts = random.Random(seed).sample(prompts, num_prompts)
        return prompts
    if dataset.endswith(".jsonl") or os.path.sep in dataset or os.path.exists(dataset):
        return load_file(dataset)[:num_prompts]
    raise ValueError(
        f"unknown dataset {dataset!r}: expected one of {', '.join(DATASET_NAMES)}, or the path of "
        f"a .jsonl file"
    )
