"""DeepSeek-V3 tool calls (its chat template's format):
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{ARGS}\n```<｜tool▁call▁end｜>
(more calls follow, each in its own begin/end pair) <｜tool▁calls▁end｜>."""

from __future__ import annotations

import json
import re

from foretell.server.tool_parsers.base import ToolCall, ToolParser, arguments_schema, arguments_text, lark_json, lark_literal

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL = re.compile(re.escape(CALL_BEGIN) + r"(\w+)" + re.escape(SEP) + r"(.*?)\n```json\n(.*?)\n```"
                  + re.escape(CALL_END), re.DOTALL)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    start_marker = CALLS_BEGIN
    calls_begin = CALLS_BEGIN

    def complete_calls(self, section: str) -> list[ToolCall]:
        calls = []
        for _kind, name, args in CALL.findall(section):
            try:
                value = json.loads(args)
            except ValueError:
                continue
            calls.append(ToolCall(name.strip(), arguments_text(value)))
        return calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        more = f" ({calls})*" if parallel else ""
        rules = [f"start: {lark_literal(CALLS_BEGIN)} ({calls}){more} {lark_literal(CALLS_END)}"]
        for i, tool in enumerate(tools):
            head = lark_literal(f"{CALL_BEGIN}function{SEP}{tool['name']}\n```json\n")
            rules.append(f"call_{i}: {head} args_{i} {lark_literal(chr(10) + '```' + CALL_END)}")
            rules.append(f"args_{i}: {lark_json(arguments_schema(tool))}")
        return "\n".join(rules) + "\n"
