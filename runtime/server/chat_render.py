"""A chat request's messages rendered by the model's own chat template: tools, the calls earlier turns made, tool
results and chat_template_kwargs included.

A vision-language model's template that reads content parts gets every message as parts (a string as one text
part), images where they stood, as HF's processors pass them; a template for strings gets each image as the
model's placeholder inside the text.

A template that takes `tools` renders them and the history's calls its own way (arguments reach it as objects, as
Qwen's, Llama's and Mistral's templates expect). One that does not (the default model's) is given the tools in a
system message, earlier calls as the JSON array required/named answers are written in, and tool results as user
messages, so every template can carry a tool conversation.
"""

from __future__ import annotations

import json
from typing import Any

from ..engine.engine import Engine
from ..multimodal.content_parts import as_parts, shows_image_parts, text_part
from ..tools.protocol import ToolFunction, history_arguments
from . import openai_format as fmt
from .errors import ApiError
from .openai_protocol import ChatCompletionRequest, ChatMessage

# Keys apply_chat_template sets itself: a request's chat_template_kwargs may not override them.
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
                             "chat_template", "continue_final_message", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors"})
TOOLS_PREAMBLE = ("You can call these functions. To call them, answer with only a JSON array of calls, "
                  '[{"name": <function name>, "parameters": <arguments object>}].\n')


def takes_tools(engine: Engine) -> bool:
    return "tools" in (getattr(engine.tokenizer, "chat_template", None) or "")


def takes_image_parts(engine: Engine) -> bool:
    """Whether the model reads images and its chat template shows them from content parts."""
    placeholder = engine.image_placeholder
    return placeholder is not None and shows_image_parts(
        lambda messages: engine.tokenizer.apply_chat_template(messages, tokenize=False), placeholder)


def render_chat(engine: Engine, req: ChatCompletionRequest, tools: list[ToolFunction]) -> str:
    """The prompt text, or ApiError 400 naming what the messages or the template refuse."""
    placeholder = engine.image_placeholder or ""
    native = takes_tools(engine)
    parts = takes_image_parts(engine)
    messages = [_message(index, m, placeholder, native, parts) for index, m in enumerate(req.messages)]
    extra = _template_kwargs(req.chat_template_kwargs)
    if tools and native:
        extra["tools"] = [tool.as_template_tool() for tool in tools]
    elif tools:
        messages = _with_tools_message(messages, tools)
    if parts:
        messages = [{**message, "content": as_parts(message["content"])} for message in messages]
    try:
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        prompt.encode("utf-8")  # a lone surrogate (JSON allows "\ud800") would reach the tokenizer as a TypeError
        return prompt
    except UnicodeEncodeError as error:
        raise ApiError(400, f"a message is not valid text: {error.reason}") from None
    except Exception as error:  # noqa: BLE001 - the template's Jinja raises what it likes on orders it refuses
        raise ApiError(400, f"the chat template cannot render these messages: {error}") from None


def _message(index: int, message: ChatMessage, placeholder: str, native: bool, parts: bool) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role == "tool" and not message.tool_call_id:
        raise ApiError(400, f"{where}: a tool message needs tool_call_id (the id of the call it answers)")
    if message.tool_calls is not None and message.role != "assistant":
        raise ApiError(400, f"{where}: only assistant messages carry tool_calls")
    text = fmt.message_text(message.content, placeholder)
    out: dict[str, Any] = {"role": message.role, "content": fmt.message_parts(message.content) if parts else text}
    if message.name:
        out["name"] = message.name
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        calls = [(call.id, call.function.name, _arguments(call.function.arguments, f"{where}.tool_calls[{i}]"))
                 for i, call in enumerate(message.tool_calls)]
        if not native:
            out["content"] = _calls_text(text, calls)
            return out
        out["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
                             for call_id, name, args in calls]
    if message.role == "tool":
        if not native:
            return {"role": "user", "content": f"Result of call {message.tool_call_id}: {text}"}
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(arguments: str, where: str) -> Any:
    try:
        return history_arguments(arguments, where)
    except ValueError as error:
        raise ApiError(400, str(error)) from None


def _calls_text(content: str, calls: list[tuple[str, str, Any]]) -> str:
    array = json.dumps([{"name": name, "parameters": args} for _, name, args in calls], ensure_ascii=False)
    return f"{content}\n{array}" if content else array


def _with_tools_message(messages: list[dict[str, Any]], tools: list[ToolFunction]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(tool.as_template_tool(), ensure_ascii=False) for tool in tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=_with_text(messages[0]["content"], f"\n\n{TOOLS_PREAMBLE}{listing}"))
        return [first, *messages[1:]]
    return [{"role": "system", "content": TOOLS_PREAMBLE + listing}, *messages]


def _with_text(content: str | list[dict[str, Any]], more: str) -> str | list[dict[str, Any]]:
    """Content with `more` text at its end: in its last text part where the content is parts ending with one."""
    if isinstance(content, str):
        return content + more
    if content and content[-1]["type"] == "text":
        return [*content[:-1], text_part(content[-1]["text"] + more)]
    return [*content, text_part(more)]


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    reserved = sorted(RESERVED_KWARGS & set(kwargs or {}))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}")
    return dict(kwargs or {})
