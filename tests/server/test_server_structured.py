"""Structured outputs and tool calls over the API (issue 27) with the official `openai` client:
response_format json_schema (chat) and vLLM's structured_outputs (completions) give outputs that
validate and equal the offline engine's, with and without speculation; tools with tool_choice
named or required come back as parsed tool calls, streamed as tool_calls deltas that add up to
the non-streamed message, arguments valid against the function's parameters; bad requests get a
400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402

CHAT = [{"role": "user", "content": "plan a trip as JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
REGEX = r"[0-9]{1,2}-(ab|cd)"


def client_for(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, num_kv_blocks=160, max_model_len=512) as llm:
        chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA,
                                                                                    "disable_any_whitespace": True}),
                        use_tqdm=False)[0].outputs[0].text
        completion = llm.generate(["The cat"], SamplingParams(temperature=0, max_tokens=12,
                                                              structured_outputs={"regex": REGEX}),
                                  use_tqdm=False)[0].outputs[0].text
    return chat, completion


@pytest.mark.parametrize("use_spec", [False, True], ids=["plain", "ngram"])
def test_response_format_and_structured_outputs(request, use_spec, offline):
    want_chat, want_completion = offline
    client = client_for(request.getfixturevalue("spec_server" if use_spec else "server"))
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    content = chat.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert content == want_chat and chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL_NAME, prompt="The cat", max_tokens=12, temperature=0,
                                           extra_body={"structured_outputs": {"regex": REGEX}})
    assert completion.choices[0].text == want_completion and regex.fullmatch(REGEX, want_completion)
    choice = client.completions.create(model=MODEL_NAME, prompt="The cat", max_tokens=12, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("tool_choice", ["named", "required"])
@pytest.mark.parametrize("use_spec", [False, True], ids=["plain", "ngram"])
def test_tool_calls_stream_and_parse(request, use_spec, tool_choice):
    client = client_for(request.getfixturevalue("spec_server" if use_spec else "server"))
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else "required"
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "weather in Paris?"}], max_tokens=150,
                  temperature=0, tools=[WEATHER, TIME], tool_choice=choice, extra_body={"parallel_tool_calls": False})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.tool_calls
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    if tool_choice == "named":
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]

    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function.name:
                entry["name"] += call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in message.tool_calls]


def test_multi_turn_with_tool_results(server):
    """A conversation holding an assistant's tool call and the tool's answer renders and runs."""
    client = client_for(server)
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                         tools=[WEATHER], tool_choice="auto")
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
])
def test_bad_structured_requests_get_400(server, body, param):
    import requests

    payload = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, **body}
    response = requests.post(server.url + "/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"], error
