"""The OpenAI wire format: pydantic schemas of the requests the server accepts and of the
non-streaming responses it returns, plus the OpenAI-style error body.

Requests are checked here as far as a schema can say (types, ranges, required fields), so the
OpenAPI document tells clients and fuzzers the truth; what needs the model (prompt length, token
ids in range, a chat template) is checked when the request reaches the engine. Unknown fields are
ignored, as OpenAI-compatible servers do, so clients that send extra options still work.
Types are strict, as OpenAI's are: a boolean must be a JSON boolean (`"stream": "yes"` and
`"echo": 0` are refused), an integer a JSON integer (not true, 1.5 or "1"), a number a JSON
integer or float (not false or "0.5"), a string a JSON string.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from foretell.engine.outputs import RequestOutput

MAX_N = 128  # choices per request; each is a full sequence in the engine
MAX_LOGPROBS = 20  # the engine returns at most 20 alternatives per token
MAX_STOP_STRINGS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

NonEmptyText = Annotated[str, Field(min_length=1)]
# fail_fast: a list that is not of this type stops at its first bad item, not after millions.
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1, fail_fast=True)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # logit_bias: a token id spelled as a JSON key


class OpenAIBaseModel(BaseModel):
    # NaN and Infinity are valid for Python's JSON parser but never a valid sampling parameter.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {} or missing: any JSON
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIBaseModel):
    """vLLM's structured_outputs: exactly one constraint (SamplingParams checks the rest)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


class SamplingRequestFields(OpenAIBaseModel):
    """What completions and chat completions share: sampling, stopping, streaming."""

    model: str | None = Field(None, description="the served model name (default: the only one)")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Logits controls, OpenAI's and vLLM's (SamplingParams says what each does)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM: 1 is off")
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id -> a bias added to its logit")
    min_tokens: int = Field(0, ge=0, le=INT32_MAX, description="vLLM: no EOS or stop before this many tokens")
    bad_words: Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    allowed_token_ids: TokenIds | None = None
    user: str | None = None
    # Structured outputs (foretell/structured/): OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # foretell extensions (vLLM-style; plain OpenAI clients never see them)
    return_token_origins: bool = Field(
        False, description="foretell: each choice (each chunk when streaming) gets token_origins, "
        "saying for every token whether it was an accepted draft, the target's correction, a bonus "
        "token or a plain target token")
    use_speculation: bool = Field(
        True, description="foretell: false runs this request without drafts (the same output; "
        "to compare speed and acceptance with and without speculation)")


class CompletionRequest(SamplingRequestFields):
    # Validated on the event loop: left to right, each member failing fast, a 2M-token-id prompt
    # costs one pass over it (pydantic's smart mode made it seven).
    prompt: NonEmptyText | Annotated[list[str], Field(min_length=1, fail_fast=True)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, fail_fast=True)
    ] = Field(..., union_mode="left_to_right",
              description="a string, a list of strings, token ids, or lists of token ids")
    max_tokens: int | None = Field(16, ge=1, description="null: up to the model's max length")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCallInfo(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallInfo(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallInfo


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallInfo] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequestFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Tool calling (server/tool_calls.py): the calls come back parsed as message.tool_calls
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


# ---------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TokenOriginInfo(BaseModel):
    """How speculation produced one output token (server/token_origins.py)."""

    token_id: int
    token: str
    origin: Literal["accepted", "corrected", "bonus", "target"]
    step: int
    position: int
    num_drafts: int
    replaced_draft: int | None = None
    replaced_draft_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_origins: list[TokenOriginInfo] | None = Field(None, description="with return_token_origins")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallInfo] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_origins: list[TokenOriginInfo] | None = Field(None, description="with return_token_origins")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "foretell"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """The `usage` object of a response: the prompt counted once per prompt, all choices' tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error a client caused or must handle; rendered as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()
