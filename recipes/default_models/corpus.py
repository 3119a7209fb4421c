"""The default model family's corpus: the Python standard library's source of the machine the
recipe runs on, plus GSM8K train. Both public and permissively licensed (PSF, MIT), so any user
can rebuild the models.

GSM8K appears in two formats: the plain "Question: q\\nAnswer: a" form that foretell's GSM8K
benchmark and eval prompt with (1 to 4 solved problems a document, blank line between, like a
few-shot prompt), and a ChatML conversation (user question, assistant answer).
"""

from __future__ import annotations

import json
import os
import random
import re
import sysconfig

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GSM8K_CANDIDATES = (
    os.path.join(REPO_ROOT, "foretell", "data", "gsm8k_train.jsonl"),
    os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k_train.jsonl"),
)


def stdlib_files(include_tests: bool = True, root: str | None = None) -> list[str]:
    """Sorted paths of the standard library's .py files (no site-packages)."""
    root = root or sysconfig.get_paths()["stdlib"]
    skipped = SKIPPED_DIRS | (set() if include_tests else TEST_DIRS)
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skipped)
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"no Python standard library sources under {root}")
    return found


def stdlib_documents(include_tests: bool = True, max_chars: int | None = None) -> list[str]:
    """Source files as documents (unreadable ones skipped), up to max_chars in all."""
    docs, total = [], 0
    for path in stdlib_files(include_tests):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if max_chars is not None and total + len(text) > max_chars:
            break
        docs.append(text)
        total += len(text)
    return docs


def find_gsm8k_train(path: str | None = None) -> str:
    candidates = (path,) if path else GSM8K_CANDIDATES
    for candidate in candidates:
        if candidate and os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(f"GSM8K train not found (looked for {', '.join(c for c in candidates if c)})")


def read_gsm8k(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_plain(problem: dict) -> str:
    return f"Question: {problem['question']}\nAnswer: {problem['answer']}"


def gsm8k_chatml(problem: dict) -> str:
    return (f"<|im_start|>user\n{problem['question']}<|im_end|>\n"
            f"<|im_start|>assistant\n{problem['answer']}<|im_end|>\n")


def gsm8k_documents(problems: list[dict], seed: int = 0) -> list[str]:
    """Plain few-shot-style documents of 1-4 problems, and one ChatML document per problem."""
    rng = random.Random(seed)
    order = list(range(len(problems)))
    rng.shuffle(order)
    docs, i = [], 0
    while i < len(order):
        n = rng.randint(1, 4)
        docs.append("\n\n".join(gsm8k_plain(problems[j]) for j in order[i : i + n]) + "\n\n")
        i += n
    docs += [gsm8k_chatml(p) for p in problems]
    return docs


def perturb_numbers(text: str, rng: random.Random) -> str:
    """The same question with fresh numbers (each integer redrawn with as many digits), so a
    target that memorised GSM8K train must answer it as it would an unseen question."""

    def redraw(match: re.Match) -> str:
        digits = len(match.group())
        low = 10 ** (digits - 1) if digits > 1 else 1
        return str(rng.randint(low, 10**digits - 1))

    return re.sub(r"\d+", redraw, text)
