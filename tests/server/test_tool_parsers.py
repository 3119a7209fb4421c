"""Tool-call parsers (foretell/server/tool_parsers/), per format: whole outputs with content,
one and several calls, unclosed calls, text that only looks like a call; the streamed split into
content and tool_calls deltas fed in every chunking adds up to the whole parse; each format's
grammar admits the format's own text (llguidance matcher over the characters) and refuses
arguments outside the schema; the template picks its parser."""

from __future__ import annotations

import json

import llguidance
import pytest

from foretell.server.tool_calls import ToolCallStream
from foretell.server.tool_parsers import PARSERS, parser_for_template
from foretell.server.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                           "days": {"type": "integer"}},
                                           "required": ["city"], "additionalProperties": False}},
    {"name": "now"},
]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]


def hermes_text(calls) -> str:
    return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


def llama_text(calls) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def deepseek_text(calls) -> str:
    body = "".join(f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a)}\n```{CALL_END}" for n, a in calls)
    return CALLS_BEGIN + body + CALLS_END


WRITERS = {"hermes": hermes_text, "llama3_json": llama_text, "deepseek_v3": deepseek_text}


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("num_calls", [1, 2])
def test_whole_output_parses(name, num_calls):
    parser = PARSERS[name]()
    prefix = "" if name == "llama3_json" else "Let me check. "
    content, calls = parser.parse(prefix + WRITERS[name](CALLS[:num_calls]))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:num_calls]
    assert content == (prefix or None)


@pytest.mark.parametrize("name", list(PARSERS))
def test_plain_text_has_no_calls(name):
    for text in ["Paris is sunny.", "a { brace", "<tool_call> not json </tool_call>", ""]:
        content, calls = PARSERS[name]().parse(text)
        assert calls == [] and content == text


def test_hermes_unclosed_last_call_is_parsed_at_the_end():
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n'
    content, calls = PARSERS["hermes"]().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")] and content is None


def test_llama3_python_tag():
    content, calls = PARSERS["llama3_json"]().parse('<|python_tag|>{"name": "now", "parameters": {}}')
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")] and content is None


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(name, chunk):
    prefix = "" if name == "llama3_json" else "Checking <tool"  # a marker's prefix that is only text
    text = prefix + WRITERS[name](CALLS)
    want_content, want_calls = PARSERS[name]().parse(text)
    stream = ToolCallStream(PARSERS[name]())
    content, calls = "", []
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, i == len(pieces) - 1)
        content += c
        calls.extend(deltas)
    assert content == (want_content or "")
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in calls] == [
        (i, c.name, c.arguments) for i, c in enumerate(want_calls)]
    assert len({d["id"] for d in calls}) == len(calls) and stream.called


def test_streamed_text_without_calls_is_all_content():
    stream = ToolCallStream(PARSERS["hermes"]())
    out = [stream.feed(p, False)[0] for p in ["Hello <", "tool", " world"]] + [stream.feed("", True)[0]]
    assert "".join(out) == "Hello <tool world" and not stream.called


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar takes exactly this text (fed byte by byte through a byte tokenizer)."""
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar))
    tokens = tokenizer.tokenize_bytes(text.encode())
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("name", list(PARSERS))
def test_grammar_admits_the_format_and_refuses_bad_arguments(name):
    parser = PARSERS[name]()
    compact = {"hermes": lambda calls: "\n".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, separators=(",", ":"))}\n</tool_call>' for n, a in calls),
        "llama3_json": lambda calls: "; ".join(json.dumps({"name": n, "parameters": a}, separators=(",", ":"))
                                               for n, a in calls),
        "deepseek_v3": lambda calls: CALLS_BEGIN + "".join(
            f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a, separators=(',', ':'))}\n```{CALL_END}"
            for n, a in calls) + CALLS_END}[name]
    assert accepts(parser.grammar(TOOLS, parallel=False), compact(CALLS[:1]))
    assert accepts(parser.grammar(TOOLS, parallel=True), compact(CALLS))
    assert not accepts(parser.grammar(TOOLS, parallel=False), compact(CALLS))  # one call only
    assert not accepts(parser.grammar(TOOLS, parallel=False), compact([("get_weather", {"city": 3})]))
    assert not accepts(parser.grammar(TOOLS[:1], parallel=False), compact([("now", {})]))  # named: that tool only


def test_template_picks_its_parser():
    assert parser_for_template("{{ '<tool_call>' }}<|im_start|>").name == "hermes"
    assert parser_for_template("<|start_header_id|>ipython<|python_tag|>").name == "llama3_json"
    assert parser_for_template("{{'<｜tool▁calls▁begin｜>'}}").name == "deepseek_v3"
    assert parser_for_template(None).name == "hermes"
