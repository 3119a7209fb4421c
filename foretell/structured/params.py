"""StructuredOutputsParams: what a request's output must match, with vLLM's field names.

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `json_object` (True: any JSON
object), `regex`, `choice` (a list of strings: the output is one of them) or `grammar` (a Lark or
GBNF/EBNF grammar) is set. Validated on construction, without a tokenizer, by the grammar engine
(llguidance): a schema it cannot compile or a regex that does not parse raises ValueError naming
the field and the engine's message, so a bad request is refused before it is queued.

No torch here (the core imports this through sampling_params.py); llguidance is imported when a
request first uses structured outputs.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field, fields
from typing import Any

FIELDS = ("json", "json_object", "regex", "choice", "grammar")


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a base dependency; only a broken install gets here
        raise ImportError(
            "structured outputs need the llguidance package (a foretell dependency): "
            "pip install 'llguidance==1.9.1'"
        ) from e
    return llguidance


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    json_object: bool | None = None  # True: any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF (llama.cpp's form)
    # json / json_object: True allows no whitespace between JSON tokens (vLLM's
    # option; a small model may otherwise emit whitespace until max_tokens).
    disable_any_whitespace: bool = False
    # The llguidance grammar the fields above compile to; built on construction.
    compiled: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(FIELDS)}; got "
                f"{', '.join(chosen) if chosen else 'none'}"
            )
        kind = chosen[0]
        self.compiled = self._compile(kind)
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(self.compiled)
        if is_error:
            raise ValueError(f"structured_outputs.{kind} is not valid: {'; '.join(messages)}")

    @property
    def kind(self) -> str:
        return next(name for name in FIELDS if getattr(self, name) not in (None, False))

    def _compile(self, kind: str) -> str:
        llg = _llguidance()
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json_module.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema; its text does not parse: {e}") from e
            if not isinstance(value, (dict, bool)):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (an object), got {type(value).__name__}"
                )
            return self._json_grammar(value)
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be True (or unset), got {value!r}")
            return self._json_grammar({"type": "object"})
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.regex must be a non-empty string, got {value!r}")
            return llg.grammar_from("regex", value)
        if kind == "choice":
            if not isinstance(value, list) or not value or any(not isinstance(c, str) or not c for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
            return llg.grammar_from("choice", json_module.dumps(value))
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"structured_outputs.grammar must be a non-empty grammar text, got {value!r}")
        try:
            return llg.grammar_from("grammar", value)
        except Exception as e:  # noqa: BLE001 -- the engine raises several types for a bad grammar
            raise ValueError(f"structured_outputs.grammar is not valid: {e}") from e

    def _json_grammar(self, schema) -> str:
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")
        defaults = {"whitespace_flexible": False} if self.disable_any_whitespace else None
        return _llguidance().LLMatcher.grammar_from_json_schema(json_module.dumps(schema), defaults=defaults)

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """An instance from itself or a dict with vLLM's keys (unknown keys are an error)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a dict with one of "
                f"{', '.join(FIELDS)}; got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; expected one of {', '.join(FIELDS)}")
        return cls(**value)
