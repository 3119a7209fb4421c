"""The `repetitive` prompt set of `foretell bench`: tasks whose answers repeat text the model has
already seen, the workload suffix decoding is for (agentic loops, code edits, re-asked
questions). Built from the shipped data (foretell/data: GSM8K train, HumanEval), deterministic.

Four kinds, interleaved:
  quote     a multi-turn loop that quotes the earlier turn: GSM8K question, its worked answer,
            then the same question again;
  template  "answer again with the same template": two worked GSM8K answers, then the first
            question asked again;
  rewrite   a HumanEval function (prompt + canonical solution), then "the same function with one
            change" and its header with the new name: the body is to be copied;
  again     a GSM8K question asked as plain "Question: ...\\nAnswer:", asked again in the next
            round (an agent re-asking a sub-question): the second answer is the first one's,
            which the global suffix cache holds once the first request has finished.
"""

from __future__ import annotations

from foretell.bench.prompt_files import Prompt, data_path, read_jsonl

KINDS = ("quote", "template", "rewrite", "again")


def _quote(record: dict) -> str:
    q, a = record["question"], record["answer"]
    return f"Question: {q}\nAnswer: {a}\n\nQuestion: {q}\nAnswer:"


def _template(first: dict, second: dict) -> str:
    return (f"Question: {first['question']}\nAnswer: {first['answer']}\n\n"
            f"Question: {second['question']}\nAnswer: {second['answer']}\n\n"
            f"Answer again with the same template.\nQuestion: {first['question']}\nAnswer:")


def _rewrite(record: dict) -> str:
    name = record["entry_point"]
    source = record["prompt"] + record["canonical_solution"]
    header = record["prompt"].replace(f"def {name}(", f"def {name}_v2(")
    return (f"{source}\n\n# The same function with one change: it is renamed {name}_v2.\n"
            f"{header}")


def _again(record: dict) -> str:
    return f"Question: {record['question']}\nAnswer:"


def repetitive_prompts(num_prompts: int, seed: int = 0) -> list[Prompt]:
    """num_prompts prompts of the four kinds in turn; each "again" question is asked a second
    time in the next round. The seed picks which GSM8K and HumanEval records are used."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    gsm8k = read_jsonl(data_path("gsm8k_train.jsonl"))
    humaneval = read_jsonl(data_path("humaneval.jsonl"))
    g = (seed * 7919) % len(gsm8k)
    h = (seed * 31) % len(humaneval)
    prompts: list[Prompt] = []
    asked: list[tuple[str, str]] = []  # "again" prompts waiting for their repeat
    round_index = 0
    while len(prompts) < num_prompts:
        for kind in KINDS:
            if len(prompts) >= num_prompts:
                break
            if kind == "quote":
                text, source = _quote(gsm8k[g]), f"repetitive:quote:gsm8k_train:{g}"
                g = (g + 1) % len(gsm8k)
            elif kind == "template":
                text = _template(gsm8k[g], gsm8k[(g + 1) % len(gsm8k)])
                source = f"repetitive:template:gsm8k_train:{g}"
                g = (g + 2) % len(gsm8k)
            elif kind == "rewrite":
                text, source = _rewrite(humaneval[h]), f"repetitive:rewrite:{humaneval[h]['task_id']}"
                h = (h + 1) % len(humaneval)
            elif asked and round_index % 2 == 1:
                text, source = asked.pop(0)
                source += ":again"
            else:
                text, source = _again(gsm8k[g]), f"repetitive:again:gsm8k_train:{g}"
                asked.append((text, source))
                g = (g + 1) % len(gsm8k)
            prompts.append(Prompt(text=text, source=source))
        round_index += 1
    return prompts
