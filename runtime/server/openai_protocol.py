"""Request bodies of the OpenAI routes, as pydantic models: wrong types, unknown fields and out-of-range values
are refused with the field named (strict types: "2" is not a number). Responses are built as plain dicts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ApiError

NonNegInt = Annotated[int, Field(ge=0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
# OpenAI's bounds; both routes take furcate's extra sampling fields too (as SGLang's server does).
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Strict):
    """Fields both routes share: OpenAI's, then furcate/SGLang extras (sent through the client's extra_body)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: str | list[str] | None = None
    seed: NonNegInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    user: str | None = None
    # Extras.
    top_k: int | None = None
    min_p: Probability | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegInt | None = None
    stop_token_ids: list[NonNegInt] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    allow_approximate_schema: bool | None = None
    rid: str | None = None
    # sglang-router --pd-disaggregation pairs the prefill and decode halves of a request with these.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: NonNegInt | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegInt | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageUrl(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(Strict):
    name: str
    arguments: str


class AssistantToolCall(Strict):
    """A call an earlier assistant turn made, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning_content: str | None = None


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    # Checked by tools/protocol.py, whose messages name the tool and field at fault.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the chat template (enable_thinking, ...), as SGLang and vLLM take them.
    chat_template_kwargs: dict[str, Any] | None = None
    # With a reasoning parser: reasoning_content apart from content (SGLang's field; false: one text).
    separate_reasoning: bool = True
    # furcate's: the most tokens a reasoning model thinks before the server closes its think block.
    max_reasoning_tokens: Annotated[int, Field(ge=1)] | None = None


def parse(model: type[Strict], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise ApiError(400, "; ".join(_describe(e) for e in error.errors()[:5])) from None


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "body"
    if error["type"] == "extra_forbidden":
        return f"unknown field {where}"
    return f"{where}: {error['msg']}"
