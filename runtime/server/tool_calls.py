"""/v1/chat/completions with tools or a reasoning parser: the answer plan from the request and the server's parsers,
then `message.tool_calls` / `reasoning_content`, or their deltas as OpenAI streams them (the first delta of a call
with its id, type and name, then fragments of its arguments).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..config import ServerArgs
from ..engine.engine import Engine
from ..tools.formats import FORMATS, JSON_ARRAY, PARSER_NAMES, PYTHONIC, CallFormat, canonical
from ..tools.formats import detect as detect_format
from ..tools.protocol import ToolChoice, ToolFunction, parse_tool_choice, parse_tools
from ..tools.reasoning import ReasoningFormat, reasoning_format
from ..tools.reasoning import detect as detect_reasoning
from . import openai_format as fmt
from .answer import CONSTRAINTS, Answer, AnswerPlan, Delta
from .answer_parts import AnswerResult
from .errors import ApiError
from .openai_protocol import ChatCompletionRequest
from .sse import open_stream, send_done, send_error, send_event, stop_pumps


def request_tools(req: ChatCompletionRequest) -> tuple[list[ToolFunction], ToolChoice]:
    try:
        tools = parse_tools(req.tools) if req.tools is not None else []
        if not tools:
            if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
                raise ValueError("tool_choice required or a named function needs tools")
            return [], ToolChoice("none")
        return tools, parse_tool_choice(req.tool_choice, tools)
    except ValueError as error:
        raise ApiError(400, str(error)) from None


def server_reasoning(engine: Engine, settings: ServerArgs) -> ReasoningFormat | None:
    name = settings.reasoning_parser or detect_reasoning(getattr(engine.tokenizer, "chat_template", None))
    return None if name in (None, "none") else reasoning_format(name)


def call_format(engine: Engine, settings: ServerArgs, choice: ToolChoice) -> tuple[CallFormat | None, bool]:
    """(format, pythonic): required and named calls take the model's format, or the JSON array when it has none
    that a grammar describes; auto needs the model's own."""
    if not choice.calls:
        return None, False
    named = settings.tool_call_parser
    name = canonical(named) if named else detect_format(getattr(engine.tokenizer, "chat_template", None))
    if choice.mode != "auto":
        return FORMATS.get(name, JSON_ARRAY), False
    if name is None:
        raise ApiError(400, "tool_choice auto needs the model's tool call format, and this model's chat template "
                            "shows none furcate knows; start the server with --tool-call-parser "
                            f"{{{','.join(PARSER_NAMES)}}} (required and named tool_choice work with any model)")
    return (None, True) if name == PYTHONIC else (FORMATS[name], False)


def answer_plan(req: ChatCompletionRequest, prompt_ids: list[int], prompt: str, sampling: dict[str, Any],
                tools: list[ToolFunction], choice: ToolChoice, call: tuple[CallFormat | None, bool],
                reasoning: ReasoningFormat | None, images: list[Any] | None) -> AnswerPlan:
    constraint = {k: sampling[k] for k in CONSTRAINTS if k in sampling}
    if constraint and choice.calls:
        raise ApiError(400, "response_format, json_schema, regex and ebnf cannot be combined with tool calls; send "
                            "tool_choice none for a constrained answer")
    free = {k: v for k, v in sampling.items() if k not in CONSTRAINTS and k != "max_new_tokens"}
    return AnswerPlan(prompt_ids, free, constraint, sampling["max_new_tokens"], reasoning,
                      reasoning.opened_by(prompt) if reasoning else False, req.max_reasoning_tokens, tools, choice,
                      call[0], call[1], req.parallel_tool_calls is not False and choice.mode != "named",
                      (req.top_logprobs or 0) if req.logprobs else None, images, req.rid)


def message(result: AnswerResult, reasoning: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": result.content}
    if reasoning:
        out["reasoning_content"] = result.reasoning
    if result.calls:
        out["tool_calls"] = [call.as_openai() for call in result.calls]
    return out


async def complete(engine: Engine, plan: AnswerPlan, n: int) -> list[AnswerResult]:
    answers = [Answer(engine, plan, False, sample) for sample in range(n)]
    try:
        async with asyncio.TaskGroup() as group:  # one answer failing cancels the others' requests
            for answer in answers:
                group.create_task(_drain(answer))
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [answer.result for answer in answers]


async def _drain(answer: Answer) -> None:
    async for _ in answer.run():
        pass


def choices(results: list[AnswerResult], plan: AnswerPlan) -> list[dict[str, Any]]:
    return [{"index": index, "message": message(result, plan.reasoning is not None),
             "finish_reason": result.finish_reason, "matched_stop": result.matched_stop,
             "logprobs": _logprobs(plan, result.logprobs, result.top_logprobs)} for index, result in enumerate(results)]


def _logprobs(plan: AnswerPlan, entries: list[Any], tops: list[Any]) -> dict[str, Any] | None:
    """OpenAI's chat logprobs of the generated tokens (the text a call format fixes was not generated: it has
    none)."""
    return None if plan.top_logprobs is None else fmt.chat_logprobs(entries, tops)


async def stream(request: web.Request, engine: Engine, plan: AnswerPlan, n: int, model: str,
                 include_usage: bool) -> web.StreamResponse:
    """Each sampled answer runs on its own; their deltas are merged as they come. The response opens with the
    first delta, so an error before any (a schema that does not compile) is still a 4xx status."""
    queue: asyncio.Queue = asyncio.Queue()
    answers = [Answer(engine, plan, True, sample) for sample in range(n)]
    pumps = [asyncio.ensure_future(_pump(index, answer, queue)) for index, answer in enumerate(answers)]
    writer = _DeltaWriter(fmt.response_id("chatcmpl"), model, plan.reasoning is not None)
    response: web.StreamResponse | None = None
    try:
        pending = n
        while pending:
            index, item = await queue.get()
            if isinstance(item, Exception) and response is None:
                raise ApiError(400 if isinstance(item, ValueError) else 500, str(item))
            if response is None:
                response = await open_stream(request)
            if isinstance(item, Exception):
                await send_error(response, item)
                break
            if isinstance(item, AnswerResult):
                pending -= 1
            await send_event(response, writer.chunk(index, item))
        if include_usage:
            await send_event(response, writer.usage(plan, [a.result for a in answers]))
        await send_done(response)
        return response
    finally:
        await stop_pumps(pumps)


async def _pump(index: int, answer: Answer, queue: asyncio.Queue) -> None:
    try:
        async for delta in answer.run():
            await queue.put((index, delta))
            await _put_logprobs(index, answer, queue)
        await _put_logprobs(index, answer, queue)
        await queue.put((index, answer.result))
    except (ValueError, RuntimeError) as error:
        await queue.put((index, error))


@dataclass(frozen=True)
class _Logprobs:
    entries: list[Any]
    tops: list[Any]


async def _put_logprobs(index: int, answer: Answer, queue: asyncio.Queue) -> None:
    if answer.plan.top_logprobs is not None:
        entries, tops = answer.new_logprobs()
        if entries:
            await queue.put((index, _Logprobs(entries, tops)))


class _DeltaWriter:
    """Answer deltas as chat.completion.chunk events."""

    def __init__(self, rid: str, model: str, reasoning: bool) -> None:
        self.rid, self.model, self.reasoning = rid, model, reasoning
        self.started: set[int] = set()

    def chunk(self, index: int, item: Delta | AnswerResult | _Logprobs) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if index not in self.started:
            self.started.add(index)
            delta = {"role": "assistant", "content": ""}
        finish = matched = logprobs = None
        if isinstance(item, AnswerResult):
            finish, matched = item.finish_reason, item.matched_stop
        elif isinstance(item, _Logprobs):
            logprobs = fmt.chat_logprobs(item.entries, item.tops)
        else:
            delta.update(_delta(item))
        choice = {"index": index, "delta": delta, "finish_reason": finish, "matched_stop": matched,
                  "logprobs": logprobs}
        return fmt.envelope("chat.completion.chunk", self.rid, self.model, choices=[choice])

    def usage(self, plan: AnswerPlan, results: list[AnswerResult]) -> dict[str, Any]:
        return fmt.envelope("chat.completion.chunk", self.rid, self.model, choices=[],
                            usage=fmt.usage(len(plan.prompt_ids), sum(r.completion_tokens for r in results),
                                            results[0].cached_tokens if results else 0))


def _delta(item: Delta) -> dict[str, Any]:
    if item.kind == "content":
        return {"content": item.text}
    if item.kind == "reasoning":
        return {"reasoning_content": item.text}
    if item.kind == "call":
        return {"tool_calls": [{"index": item.index, "id": item.call_id, "type": "function",
                                "function": {"name": item.text, "arguments": ""}}]}
    return {"tool_calls": [{"index": item.index, "function": {"arguments": item.text}}]}
