"""Llama-3.1/3.2 JSON tool calls: the model answers with {"name": ..., "parameters": {...}}
(optionally after <|python_tag|>); several calls are joined by ";". A call is the whole answer:
the section starts at the first "{" of an output that begins with one (or with the tag)."""

from __future__ import annotations

from foretell.server.tool_parsers.base import ToolCall, ToolParser, arguments_text, call_object_schema, json_objects, lark_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_marker = "{"

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            return len(text) - len(stripped) + len(PYTHON_TAG)
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):  # the answer may still begin a call
            return len(text)
        return 0

    def complete_calls(self, section: str) -> list[ToolCall]:
        objects, _ = json_objects(section)
        return [ToolCall(o["name"], arguments_text(o.get("parameters", o.get("arguments"))))
                for o in objects if isinstance(o.get("name"), str)]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.section_start(text)
        if start is None:
            return text, []
        calls = self.complete_calls(text[start:])
        return (None, calls) if calls else (text, [])

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {lark_json(call_object_schema(tools, 'parameters'))}\n"
