"""Structured outputs and tool calling on the server's side (serving.py and serving_chat.py call these).

- structured_outputs_of(): OpenAI's response_format ({"type": "json_object"} and {"type":
  "json_schema", "json_schema": {"schema": ...}}) or vLLM's structured_outputs field, as
  SamplingParams.structured_outputs (a 400 when both are given).
- ToolPlan: a chat request's tools and tool_choice. "none" (or no tools): no tools are shown to
  the template and nothing is parsed; "auto": the template shows the tools and the output is
  parsed for calls in the chat template's format (tool_parsers/); "required" or a named function:
  the output is also constrained by a grammar of that format with each tool's parameters schema,
  so the model always calls and the arguments always parse.
- ToolCallStream: the streamed form: content streams as it comes (a possible start marker held
  back), each call goes out as an OpenAI tool_calls delta once it is closed (name, id and the whole
  arguments in one delta), and calls still open at the end are parsed from what was written.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from foretell.server.protocol import APIError, ChatCompletionRequest, SamplingRequestFields
from foretell.server.tool_parsers import ToolCall, ToolParser, parser_named


def structured_outputs_of(req: SamplingRequestFields) -> dict | None:
    """The SamplingParams.structured_outputs value the request asks for, or None."""
    fmt, vllm = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and vllm is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="response_format")
    if vllm is not None:
        return vllm.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) or {}
    if fmt is None or fmt.type == "text":
        return None
    # OpenAI's JSON comes compact: no whitespace between JSON tokens (a small
    # model left free may write whitespace until max_tokens).
    if fmt.type == "json_object":
        return {"json_object": True, "disable_any_whitespace": True}
    if fmt.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs a json_schema object",
                       param="response_format.json_schema")
    return {"json": fmt.json_schema.schema_ or {"type": "object"}, "disable_any_whitespace": True}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(call: ToolCall, index: int | None = None, call_id: str | None = None) -> dict:
    out = {"id": call_id or new_call_id(), "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


@dataclass
class ToolPlan:
    tools: list[dict]  # the function definitions the template is shown (empty: none)
    parser: ToolParser | None  # None: the output is not parsed for calls
    constraint: dict | None = None  # structured_outputs forcing a call (required / named)

    @property
    def active(self) -> bool:
        return self.parser is not None


def plan_tools(req: ChatCompletionRequest, chat_template: str | None, parser_name: str = "auto") -> ToolPlan:
    """What the request's tools and tool_choice ask for (a 400 for a choice naming no tool);
    parser_name: the server's --tool-call-parser ("auto": the chat template's format)."""
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if functions else "none")
    if choice != "none" and not functions:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools",
                       param="tool_choice")
    if choice == "none":
        return ToolPlan([], None)
    parser = parser_named(parser_name, chat_template)
    if choice == "auto":
        return ToolPlan(functions, parser)
    chosen = functions
    if not isinstance(choice, str):
        chosen = [f for f in functions if f["name"] == choice.function.name]
        if not chosen:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not "
                           f"among the tools ({', '.join(f['name'] for f in functions)})", param="tool_choice")
    if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
        raise APIError(400, "tool_choice required or a named function constrains the output already; "
                       "leave response_format and structured_outputs unset", param="tool_choice")
    grammar = parser.grammar(chosen, parallel=req.parallel_tool_calls and isinstance(choice, str))
    return ToolPlan(functions, parser, {"grammar": grammar})


def render_with_tools(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict]) -> list[int]:
    """The chat template's token ids with the tools shown to it (OpenAI's tools list form)."""
    ids = tokenizer.hf.apply_chat_template(
        messages, tools=[{"type": "function", "function": t} for t in tools],
        add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def message_dicts(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template reads them (assistant tool calls with their arguments as
    objects where they parse, tool results with their call id)."""
    import json

    out = []
    for m in req.messages:
        message = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = call.function.arguments
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        out.append(message)
    return out


def chat_message(text: str, plan: ToolPlan) -> tuple[dict, bool]:
    """(the response message, whether it calls tools) of a finished choice."""
    if not plan.active:
        return {"role": "assistant", "content": text}, False
    content, calls = plan.parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": [call_json(c) for c in calls]}, True


@dataclass
class ToolCallStream:
    """One streamed choice's split into content deltas and tool-call deltas."""

    parser: ToolParser
    text: str = ""  # everything released by the stream so far
    sent_content: int = 0  # characters of text sent as content
    section_start: int | None = None
    sent_calls: int = 0
    ids: list[str] = field(default_factory=list)

    def feed(self, new_text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls deltas) after new_text; with finished, flush everything."""
        self.text += new_text
        if self.section_start is None:
            self.section_start = self.parser.section_start(self.text)
        if self.section_start is None:
            end = len(self.text) if finished else len(self.text) - self.parser.holdback(self.text)
            content, self.sent_content = self.text[self.sent_content:end], max(self.sent_content, end)
            return content, []
        content = self.text[self.sent_content:self.section_start]
        self.sent_content = max(self.sent_content, self.section_start)
        section = self.text[self.section_start:]
        calls = self.parser.final_calls(section) if finished else self.parser.complete_calls(section)
        deltas = [call_json(c, index=i) for i, c in enumerate(calls[self.sent_calls:], start=self.sent_calls)]
        self.sent_calls = max(self.sent_calls, len(calls))
        if finished and not calls:  # a marker but no call parsed: it was content after all
            content += section
        return content, deltas

    @property
    def called(self) -> bool:
        return self.sent_calls > 0
