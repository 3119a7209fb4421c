"""GSM8K: few-shot prompts from the train split, exact match on the final number.

Prompt: `num_fewshot` solved train problems ("Question: ...\\nAnswer: <solution ending in
#### N>", blank line between), then "Question: <test question>\\nAnswer:". Generation is greedy
and stops at a blank line or at "Question:".

Scoring, both against the number after `####` in the reference answer, compared as numbers
(commas, a leading $ and a trailing period ignored; "18.00" equals "18"):
  strict:   the first number after `####` in the completion (the format the shots teach);
  flexible: the last number anywhere in the completion (a fallback for models that skip ####).
Accuracy comes with its standard error, sqrt(p (1 - p) / (n - 1)).

With speculative decoding the questions run again without it; greedy outputs, and so accuracy,
must be identical, and the report says whether they are.
"""

from __future__ import annotations

import math
import random
import re
import time
from decimal import Decimal, InvalidOperation
from typing import Any

from foretell.bench.datasets import data_path, read_jsonl

STOP = ["Question:", "\n\n"]
STRICT = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def normalize_number(text: str | None) -> str | None:
    """'$1,234.50' -> '1234.5'; None for anything that is not a number."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_strict(completion: str) -> str | None:
    m = STRICT.search(completion)
    return normalize_number(m.group(1)) if m else None


def extract_flexible(completion: str) -> str | None:
    numbers = NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def reference_answer(answer: str) -> str:
    """The number after #### in a GSM8K answer field."""
    value = extract_strict(answer)
    if value is None:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer[-80:]!r}")
    return value


def fewshot_examples(train: list[dict], num_fewshot: int, seed: int) -> list[dict]:
    if num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if num_fewshot > len(train):
        raise ValueError(
            f"--num-fewshot {num_fewshot} is more than the {len(train)} train examples"
        )
    return random.Random(seed).sample(train, num_fewshot)


def build_prompt(shots: list[dict], question: str) -> str:
    parts = [f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots]
    return "".join(parts) + f"Question: {question}\nAnswer:"


def accuracy(correct: list[bool]) -> tuple[float, float | None]:
    n = len(correct)
    if n == 0:
        return 0.0, None
    p = sum(correct) / n
    return p, (math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None)


def score(completions: list[str], references: list[str]) -> dict[str, Any]:
    strict = [extract_strict(c) for c in completions]
    flexible = [extract_flexible(c) for c in completions]
    strict_ok = [s is not None and s == r for s, r in zip(strict, references)]
    flexible_ok = [f is not None and f == r for f, r in zip(flexible, references)]
    acc, se = accuracy(strict_ok)
    facc, fse = accuracy(flexible_ok)
    return {
        "num_questions": len(completions),
        "strict_match": acc,
        "strict_match_stderr": se,
        "strict_correct": sum(strict_ok),
        "flexible_match": facc,
        "flexible_match_stderr": fse,
        "flexible_correct": sum(flexible_ok),
        "num_without_hash_answer": sum(s is None for s in strict),
        "samples": [
            {"strict": s, "flexible": f, "reference": r, "strict_correct": so,
             "flexible_correct": fo}
            for s, f, r, so, fo in zip(strict, flexible, references, strict_ok, flexible_ok)
        ],
    }


SPEC_STAT_KEYS = (
    "num_speculative_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
    "acceptance_rate", "mean_acceptance_length", "accepted_per_position",
    "acceptance_per_position", "accepted_count_histogram",
)


def generate(model: str, engine_kwargs: dict, speculative_config, prompts: list[str],
             max_tokens: int, chat: bool, progress: bool) -> dict[str, Any]:
    """Greedy completions of prompts with one LLM, its stats, and its throughput."""
    from foretell import LLM, SamplingParams
    from foretell.bench.sweep import release

    llm = LLM(model, speculative_config=speculative_config, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP)
    # Warm up (first kernels, allocator) so that tokens/s with and without speculation compare.
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    if chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outs = llm.chat(conversations, params, use_tqdm=progress)
    else:
        outs = llm.generate(prompts, params, use_tqdm=progress)
    wall = time.perf_counter() - start
    stats = llm.get_stats()
    release(llm)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "stats": stats,
    }


def run_gsm8k(
    model: str,
    engine_kwargs: dict[str, Any],
    speculative_config: dict | None = None,
    num_fewshot: int = 5,
    limit: int | None = None,
    max_tokens: int = 256,
    fewshot_seed: int = 1234,
    chat: bool = False,
    check_greedy: bool = True,
    log_samples: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    test = read_jsonl(data_path("gsm8k_test.jsonl"))[:limit]
    shots = fewshot_examples(read_jsonl(data_path("gsm8k_train.jsonl")), num_fewshot, fewshot_seed)
    prompts = [build_prompt(shots, r["question"]) for r in test]
    references = [reference_answer(r["answer"]) for r in test]
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "speculative_config"}

    run = generate(model, engine_kwargs, speculative_config, prompts, max_tokens, chat, progress)
    scores = score(run["texts"], references)
    samples = scores.pop("samples")
    report: dict[str, Any] = {
        "task": "gsm8k",
        "model": model,
        "speculative_config": speculative_config,
        "num_fewshot": num_fewshot,
        "fewshot_seed": fewshot_seed,
        "limit": limit,
        "max_tokens": max_tokens,
        "chat": chat,
        **scores,
        "tokens_per_s": run["tokens_per_s"],
        "wall_s": run["wall_s"],
        "generated_tokens": run["generated_tokens"],
        "spec_decode": (
            {k: run["stats"][k] for k in SPEC_STAT_KEYS if k in run["stats"]}
            if speculative_config else None
        ),
        "greedy_check": None,
    }
    if speculative_config and check_greedy:
        base = generate(model, engine_kwargs, None, prompts, max_tokens, chat, progress)
        base_scores = score(base["texts"], references)
        same = [a == b for a, b in zip(run["token_ids"], base["token_ids"])]
        report["greedy_check"] = {
            "strict_match_without_speculation": base_scores["strict_match"],
            "flexible_match_without_speculation": base_scores["flexible_match"],
            "accuracy_identical": (
                base_scores["strict_correct"] == scores["strict_correct"]
                and base_scores["flexible_correct"] == scores["flexible_correct"]
            ),
            "num_identical_outputs": sum(same),
            "outputs_identical": all(same),
            "differing_questions": [i for i, s in enumerate(same) if not s][:20],
            "tokens_per_s_without_speculation": base["tokens_per_s"],
            "speedup": (
                run["tokens_per_s"] / base["tokens_per_s"]
                if run["tokens_per_s"] and base["tokens_per_s"] else None
            ),
        }
    if log_samples:
        for i, (sample, record, text) in enumerate(zip(samples, test, run["texts"])):
            sample.update(index=i, question=record["question"], completion=text)
        report["samples"] = samples
    return report


def format_report(report: dict[str, Any]) -> str:
    from foretell.bench.report import fmt, per_position

    def pm(value, se):
        return f"{value:.4f} ± {se:.4f}" if se is not None else f"{value:.4f}"

    n = report["num_questions"]
    lines = [
        f"gsm8k, {report['num_fewshot']}-shot, {n} questions, model {report['model']}",
        f"  exact match, number after ####:  "
        f"{pm(report['strict_match'], report['strict_match_stderr'])}"
        f"  ({report['strict_correct']}/{n}; {report['num_without_hash_answer']} without ####)",
        f"  exact match, last number:        "
        f"{pm(report['flexible_match'], report['flexible_match_stderr'])}  "
        f"({report['flexible_correct']}/{n})",
        f"  generation: {report['generated_tokens']} tokens, "
        f"{fmt(report['tokens_per_s'], '.1f')} tok/s",
    ]
    spec = report.get("spec_decode")
    if spec:
        config = report["speculative_config"]
        lines.append(
            f"  speculative decoding ({config['method']}, k={spec.get('num_speculative_tokens')}): "
            f"acceptance rate {fmt(spec.get('acceptance_rate'))}, mean acceptance length "
            f"{fmt(spec.get('mean_acceptance_length'))}, per position "
            f"{per_position(spec.get('acceptance_per_position'))}"
        )
    check = report.get("greedy_check")
    if check:
        verdict = "identical" if check["accuracy_identical"] else "DIFFERENT (a bug: please report)"
        lines.append(
            f"  without speculation: strict {check['strict_match_without_speculation']:.4f}, "
            f"{fmt(check['tokens_per_s_without_speculation'], '.1f')} tok/s "
            f"(speedup {fmt(check['speedup'])}); greedy accuracy {verdict}; outputs identical "
            f"for {check['num_identical_outputs']}/{n} questions"
        )
    return "\n".join(lines)
