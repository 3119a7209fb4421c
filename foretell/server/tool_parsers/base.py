"""ToolParser: what every tool-call format provides. A format is a tool-call section that starts
with a marker (`start_marker`); parse() splits a whole output into its plain content and its
calls, complete_calls() finds the calls already closed in a growing section (for streaming), and
grammar() writes a Lark grammar (llguidance's dialect, with %json for arguments) that admits
exactly the section of one or more calls of the given tools, so the arguments always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser:
    name = ""
    start_marker = ""  # the text that begins the tool-call section

    def section_start(self, text: str) -> int | None:
        """Where the tool-call section begins in text, or None."""
        i = text.find(self.start_marker)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        """How many trailing characters could still become the start marker (not yet streamed)."""
        for n in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-n:]):
                return n
        return 0

    def complete_calls(self, section: str) -> list[ToolCall]:
        """The calls of the section that are closed already (for streaming)."""
        raise NotImplementedError

    def final_calls(self, section: str) -> list[ToolCall]:
        """Every call of a finished section (also one whose closing marker never came)."""
        return self.complete_calls(section)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls or None, calls) of a whole output; no section: (text, [])."""
        start = self.section_start(text)
        if start is None:
            return text, []
        calls = self.final_calls(text[start:])
        if not calls:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """Lark for a section of one call (or, with parallel, one or more) of these tools."""
        raise NotImplementedError


def arguments_schema(tool: dict) -> dict:
    """The JSON schema of a tool's arguments (an object; {} when the tool declares none)."""
    params = tool.get("parameters")
    return params if params else {"type": "object", "properties": {}}


def call_object_schema(tools: list[dict], arguments_key: str) -> dict:
    """{"name": one of the tools, arguments_key: that tool's arguments}, as one JSON schema."""
    options = [
        {"type": "object",
         "properties": {"name": {"const": t["name"]}, arguments_key: arguments_schema(t)},
         "required": ["name", arguments_key], "additionalProperties": False}
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def lark_json(schema: dict) -> str:
    """A %json rule of the schema, compact (no whitespace between tokens: a small model cannot pad it)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def lark_literal(text: str) -> str:
    return json.dumps(text)


def arguments_text(value) -> str:
    """Arguments as OpenAI carries them: JSON text of an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def json_objects(text: str) -> tuple[list[dict], str]:
    """The JSON objects at the start of text, separated by whitespace, ',' or ';' (and the rest
    that did not parse yet)."""
    decoder = json.JSONDecoder()
    objects, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text) or text[i] != "{":
            return objects, text[i:]
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            return objects, text[i:]
        if isinstance(value, dict):
            objects.append(value)
        i = end
