"""Tool-call parsers: the text a model writes when it calls a tool, per chat-template family, to
OpenAI tool calls; and the grammar that makes a model write one (tool_choice required or named).

  hermes       Qwen3, Qwen2.5, Hermes (ChatML templates): <tool_call>{"name", "arguments"}</tool_call>
  llama3_json  Llama-3.1/3.2: a JSON object {"name", "parameters"} (after <|python_tag|> or alone),
               several joined by ";"
  deepseek_v3  DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
               ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

parser_for_template() picks one from the chat template's text (hermes when nothing marks another);
parser_named() is the server's --tool-call-parser: one of them by name, or "auto" (the template's).
"""

from __future__ import annotations

from foretell.server.tool_parsers.base import ToolCall, ToolParser
from foretell.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from foretell.server.tool_parsers.hermes import HermesToolParser
from foretell.server.tool_parsers.llama3_json import Llama3JsonToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
}


TOOL_CALL_PARSERS = ("auto", *PARSERS)  # --tool-call-parser's choices


def check_tool_call_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}; got {name!r}")
    return name


def parser_named(name: str, chat_template: str | None) -> ToolParser:
    """The parser called `name`, or with "auto" the one the chat template's markers say."""
    if check_tool_call_parser(name) == "auto":
        return parser_for_template(chat_template)
    return PARSERS[name]()


def parser_for_template(chat_template: str | None) -> ToolParser:
    """The parser of the family whose tool-call markers the chat template writes."""
    template = chat_template or ""
    if DeepSeekV3ToolParser.calls_begin in template:
        return DeepSeekV3ToolParser()
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "<tool_call>" not in template):
        return Llama3JsonToolParser()
    return HermesToolParser()


__all__ = ["PARSERS", "TOOL_CALL_PARSERS", "ToolCall", "ToolParser", "check_tool_call_parser", "parser_for_template",
           "parser_named"]
