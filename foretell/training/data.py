"""Training data for the EAGLE3 trainer: files -> records -> token sequences with a loss mask.

Files: `.jsonl` (one record a line), `.json` (a list of records), anything else is plain text
(the whole file is one text record). A record is one of
  "some text" or {"text": ...}                         plain text, every token is learned
  {"prompt": ..., "response"|"completion"|"output": ...} a prompt and its response
  {"prompt": ...}                                       a prompt alone (a response with --regenerate,
                                                        else learned as plain text)
  {"question": ..., "answer": ...}                      GSM8K: prompt "Question: q\\nAnswer:",
                                                        response " a" (the format foretell's
                                                        GSM8K benchmarks and eval use)
  {"messages": [{"role", "content"}, ...]}              a conversation, via the chat template
  {"conversations": [{"from", "value"}, ...]}           ShareGPT, same
With `chat=True` prompt/response and GSM8K records become a user turn and an assistant turn.

The loss mask is 1 on the tokens the target writes: the response, the assistant turns (with
their end-of-turn token), or all of a plain text. Plain texts longer than max_len are cut into
max_len pieces; prompted records are truncated to max_len.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

RESPONSE_KEYS = ("response", "completion", "output")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
ACCEPTED_KEYS = "text, prompt (+ response/completion/output), question (+ answer), messages, conversations"


@dataclass
class Record:
    """One training record before tokenization."""

    kind: str  # "text" | "completion" | "chat"
    source: str  # "file.jsonl:12", for error messages
    text: str | None = None
    prompt: str | None = None
    response: str | None = None  # None: a prompt alone
    messages: list[dict] | None = None


@dataclass
class Example:
    """A token sequence and its loss mask (1 = a token the target writes)."""

    input_ids: list[int]
    loss_mask: list[int]
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "source": self.source}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Example":
        return cls(list(obj["input_ids"]), list(obj["loss_mask"]), obj.get("source", ""))


# ------------------------------------------------------------------------------------ reading


def read_records(paths: list[str], chat: bool = False) -> list[Record]:
    """All records of the given files, in order. Raises for missing, unreadable or empty files."""
    if not paths:
        raise ValueError("no --data files given")
    records: list[Record] = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file {path} does not exist")
        found = list(_read_file(path, chat))
        if not found:
            raise ValueError(f"data file {path} has no records (it is empty or only blank lines)")
        records.extend(found)
    return records


def _read_file(path: str, chat: bool):
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {path} is not UTF-8 text: {e}") from e
    if path.endswith(".jsonl"):
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from e
            yield record_from_json(obj, f"{path}:{number}", chat)
    elif path.endswith(".json"):
        try:
            objs = json.loads(content)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(objs, list):
            raise ValueError(f"{path}: a .json data file must hold a list of records, got {type(objs).__name__}")
        for i, obj in enumerate(objs):
            yield record_from_json(obj, f"{path}[{i}]", chat)
    elif content.strip():
        yield Record("text", path, text=content)


def record_from_json(obj: Any, where: str, chat: bool = False) -> Record:
    """One JSON value -> Record; raises ValueError naming `where` for anything else."""
    if isinstance(obj, str):
        return Record("text", where, text=_nonempty(obj, where, "the record"))
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
    if "messages" in obj:
        return Record("chat", where, messages=_messages(obj["messages"], where, "messages"))
    if "conversations" in obj:
        return Record("chat", where, messages=_messages(obj["conversations"], where, "conversations"))
    if "question" in obj:
        question = _nonempty(obj["question"], where, "question")
        answer = obj.get("answer")
        if answer is not None:
            answer = _nonempty(answer, where, "answer")
        if chat:
            return _chat_pair(question, answer, where)
        return Record("completion", where, prompt=f"Question: {question}\nAnswer:",
                      response=None if answer is None else f" {answer}")
    if "prompt" in obj:
        prompt = _nonempty(obj["prompt"], where, "prompt")
        key = next((k for k in RESPONSE_KEYS if k in obj), None)
        response = None if key is None else _nonempty(obj[key], where, key)
        if chat:
            return _chat_pair(prompt, response, where)
        return Record("completion", where, prompt=prompt, response=response)
    if "text" in obj:
        return Record("text", where, text=_nonempty(obj["text"], where, "text"))
    raise ValueError(f"{where}: found none of the keys {ACCEPTED_KEYS} (keys present: {sorted(obj)})")


def _chat_pair(user: str, assistant: str | None, where: str) -> Record:
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    return Record("chat", where, messages=messages)


def _nonempty(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {name} must be a non-empty string, got {value!r:.60}")
    return value


def _messages(value: Any, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key} must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: {key}[{i}] must be an object")
        if "role" in turn:
            role, content = turn["role"], turn.get("content")
        elif "from" in turn:
            role, content = SHAREGPT_ROLES.get(turn["from"]), turn.get("value")
            if role is None:
                raise ValueError(f"{where}: {key}[{i}] has unknown speaker {turn['from']!r}")
        else:
            raise ValueError(f"{where}: {key}[{i}] needs role/content (or ShareGPT from/value)")
        if not isinstance(content, str):
            raise ValueError(f"{where}: {key}[{i}] has no text content")
        out.append({"role": role, "content": content})
    return out


# --------------------------------------------------------------------------------- tokenizing


@dataclass
class ExampleBuilder:
    """Tokenizes records with the target's (Hugging Face) tokenizer the way foretell's engine does:
    plain prompts with the tokenizer's special tokens, chats through the chat template."""

    tokenizer: Any
    max_len: int
    skipped: dict[str, int] = field(default_factory=dict)

    def examples(self, record: Record) -> list[Example]:
        """Training examples of one record (a response-less prompt is learned as text)."""
        if record.kind == "text" or (record.kind == "completion" and record.response is None):
            text = record.text if record.kind == "text" else record.prompt
            ids = self._encode(text, add_special_tokens=True)
            pieces = [ids[i : i + self.max_len] for i in range(0, len(ids), self.max_len)]
            return self._keep([Example(p, [1] * len(p), record.source) for p in pieces])
        if record.kind == "completion":
            text = record.prompt + record.response
            ids, mask = self._masked(text, [(len(record.prompt), len(text))], True)
        else:
            text, spans = self._chat_spans(record)
            ids, mask = self._masked(text, spans, False)
        return self._keep([Example(ids[: self.max_len], mask[: self.max_len], record.source)])

    def prompt_ids(self, record: Record) -> list[int] | None:
        """The prompt the target answers under --regenerate; None for plain text. For a chat,
        the turns before its last assistant turn, with the generation prompt."""
        if record.kind == "text":
            return None
        if record.kind == "completion":
            return self._encode(record.prompt, add_special_tokens=True)
        messages = record.messages
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        if last == 0:
            raise ValueError(f"{record.source}: a conversation to regenerate needs a turn before the assistant's")
        text = self._render(messages[:last], True, record.source)
        return self._encode(text, add_special_tokens=False)

    def _keep(self, examples: list[Example]) -> list[Example]:
        # A row needs the token after it and a masked target position: >= 2 tokens, mask past 0.
        kept = [e for e in examples if len(e.input_ids) >= 2 and any(e.loss_mask[1:])]
        if len(kept) < len(examples):
            self.skipped["no trainable tokens"] = self.skipped.get("no trainable tokens", 0) + len(examples) - len(kept)
        return kept

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _masked(self, text: str, spans: list[tuple[int, int]], add_special_tokens: bool):
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        mask = [int(any(a <= start < b for a, b in spans) and end > start)
                for start, end in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _render(self, messages: list[dict], add_generation_prompt: bool, source: str) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"{source}: a conversation needs the target tokenizer's chat template, and "
                f"{getattr(self.tokenizer, 'name_or_path', 'the tokenizer')} has none"
            )
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _chat_spans(self, record: Record) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        messages = record.messages
        full = self._render(messages, False, record.source)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], True, record.source) if i else ""
            upto = self._render(messages[: i + 1], False, record.source)
            if not (full.startswith(upto) and upto.startswith(before)):
                raise ValueError(
                    f"{record.source}: the chat template renders earlier turns differently once "
                    f"later turns follow, so the assistant turns cannot be located; use "
                    f"--regenerate (which trains on the last turn only) or prompt/response records"
                )
            spans.append((len(before), len(upto)))
        return full, spans


def build_examples(records: list[Record], builder: ExampleBuilder) -> list[Example]:
    examples = [e for r in records for e in builder.examples(r)]
    if not examples:
        raise ValueError(
            f"the data holds no trainable tokens ({len(records)} records; every example needs at "
            f"least 2 tokens and a response token after the first)"
        )
    return examples


def split_eval(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded random `fraction` held out (at least one when fraction > 0 and
    there are at least two examples)."""
    import random

    if not 0 <= fraction < 1:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {fraction}")
    if fraction == 0 or len(examples) < 2:
        return list(examples), []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(fraction * len(examples)))
    held = set(order[:n_eval])
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])
