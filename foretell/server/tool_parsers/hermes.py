"""Hermes-style tool calls (Qwen3's and Qwen2.5's chat templates): each call is
<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, several in a row for parallel calls."""

from __future__ import annotations

import json
import re

from foretell.server.tool_parsers.base import ToolCall, ToolParser, arguments_text, call_object_schema, lark_json

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"

    def complete_calls(self, section: str) -> list[ToolCall]:
        return [call for body in CALL.findall(section) if (call := _call(body)) is not None]

    def final_calls(self, section: str) -> list[ToolCall]:
        calls = self.complete_calls(section)
        tail = section[section.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in section else section
        if tail.strip().startswith(self.start_marker):  # the last call's end tag never came
            call = _call(tail.strip()[len(self.start_marker):])
            if call is not None:
                calls.append(call)
        return calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{more}\n"
                f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: {lark_json(call_object_schema(tools, 'arguments'))}\n")


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ToolCall(value["name"], arguments_text(value.get("arguments", value.get("parameters"))))
