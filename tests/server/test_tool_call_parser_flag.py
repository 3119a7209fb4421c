"""`foretell serve --tool-call-parser {auto,hermes,llama3_json,deepseek_v3}`: the flag reaches the
chat endpoint's tool plan (ServingContext.tool_call_parser), a named parser is used whatever the
chat template says, auto keeps the template's, and a bad name is refused naming the choices."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from foretell.server.protocol import ChatCompletionRequest  # noqa: E402
from foretell.server.serving import ServingContext  # noqa: E402
from foretell.server.tool_calls import plan_tools  # noqa: E402
from foretell.server.tool_parsers import PARSERS, TOOL_CALL_PARSERS, parser_for_template, parser_named  # noqa: E402

HERMES_TEMPLATE = "{{ '<tool_call>' }}<|im_start|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def request(tool_choice) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                 tool_choice=tool_choice)


def test_choices_are_auto_and_every_parser():
    assert TOOL_CALL_PARSERS == ("auto", "hermes", "llama3_json", "deepseek_v3")
    assert set(TOOL_CALL_PARSERS[1:]) == set(PARSERS)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "deepseek_v3"])
def test_a_named_parser_overrides_the_template(name):
    assert parser_named(name, HERMES_TEMPLATE).name == name
    plan = plan_tools(request("auto"), HERMES_TEMPLATE, name)
    assert plan.parser.name == name
    forced = plan_tools(request("required"), HERMES_TEMPLATE, name)
    # The grammar forcing a call is written in the chosen parser's format.
    assert forced.constraint == {"grammar": PARSERS[name]().grammar(
        [TOOLS[0]["function"]], parallel=True)}


def test_auto_follows_the_template():
    for template in (HERMES_TEMPLATE, "<|start_header_id|>ipython<|python_tag|>", "{{'<｜tool▁calls▁begin｜>'}}", None):
        assert parser_named("auto", template).name == parser_for_template(template).name
    assert plan_tools(request("auto"), "<|start_header_id|>ipython<|python_tag|>").parser.name == "llama3_json"


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes, llama3_json, deepseek_v3; got 'qwen'"):
        parser_named("qwen", None)
    with pytest.raises(ValueError, match="got 'mistral'"):
        ServingContext(engine=None, model_name="m", chars_per_token_bound=1, tool_call_parser="mistral")


def test_serve_flag():
    from foretell.cli import build_parser

    assert build_parser().parse_args(["serve", "--model", "m"]).tool_call_parser == "auto"
    args = build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "llama3_json"])
    assert args.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "mistral"])
