"""One chat answer built from several engine requests, so each part gets the constraint it needs.

A reasoning model thinks freely until `</think>`; the answer after it may follow a JSON schema. A tool call's name is
one of the functions' names, its arguments follow that function's parameter schema, and the text around them is
the call format's own (tools/formats.py). Each of those parts is one engine request that continues the token ids of
the parts before it, so the radix cache holds the shared prefix and each request prefills only the few tokens of
the text appended since; each constraint goes through the grammar path unchanged (exactness, compile cache,
allow_approximate_schema). Free text ends at a trigger (answer_parts.py: a stop token or a stop string, a stop
regex anchored at the start for formats whose calls start the answer).

`Answer.run()` yields `Delta`s as the parts produce text; `Answer.result` holds the whole answer afterwards.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import Engine
from ..tools.formats import CallFormat
from ..tools.protocol import ToolCall, ToolChoice, ToolFunction, new_call_id
from ..tools.pythonic import parse_pythonic
from ..tools.reasoning import ReasoningFormat, ReasoningStream
from .answer_parts import Aborted, PartRequests

CONSTRAINTS = ("json_schema", "regex", "ebnf")
MAX_CALLS = 64
# Appended after a think block the server closes itself (reasoning budget spent, or before a constrained answer).
AFTER_THINKING = "\n\n"


@dataclass(frozen=True)
class Delta:
    """New text of one kind: "content", "reasoning", "call" (text is the function's name) or "arguments"."""

    kind: str
    text: str
    index: int = 0  # the call's position among this answer's calls
    call_id: str = ""


@dataclass(frozen=True)
class AnswerPlan:
    """What every sampled answer of one request must look like."""

    prompt_ids: list[int]
    sampling: dict[str, Any]  # the engine sampling fields, with no constraint among them
    constraint: dict[str, Any]  # the answer's own constraint (response_format, json_schema, ...), or {}
    limit: int  # most tokens generated over all parts
    reasoning: ReasoningFormat | None = None
    begins_in_reasoning: bool | None = False
    max_reasoning_tokens: int | None = None
    tools: list[ToolFunction] = field(default_factory=list)
    choice: ToolChoice = ToolChoice("none")
    call_format: CallFormat | None = None
    pythonic: bool = False
    parallel: bool = True
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    images: list[Any] | None = None  # the prompt's images (chat image_url parts), in placeholder order
    rid: str | None = None

    @property
    def thinks_first(self) -> bool:
        """The think block is its own part when a constrained part follows it."""
        return (self.reasoning is not None and self.begins_in_reasoning is not False
                and bool(self.constraint or self.choice.calls))


class Answer(PartRequests):
    def __init__(self, engine: Engine, plan: AnswerPlan, stream: bool, seed_offset: int = 0) -> None:
        sampling = dict(plan.sampling, n=1)
        if "sampling_seed" in sampling:
            sampling["sampling_seed"] += seed_offset
        rid = None if plan.rid is None else f"{plan.rid}-{seed_offset}"
        super().__init__(engine, plan.prompt_ids, plan.limit, sampling, stream, plan.top_logprobs, plan.images, rid)
        self.plan = plan

    # -- the parts --------------------------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[Delta]:
        try:
            async for delta in self._parts():
                yield delta
        except Aborted:  # the result says so (finish_reason abort)
            return

    async def _parts(self) -> AsyncIterator[Delta]:
        plan = self.plan
        if plan.thinks_first:
            async for delta in self._think():
                yield delta
            if self.done:
                return
        if plan.choice.mode in ("required", "named"):
            async for delta in self._calls():
                yield delta
        elif plan.choice.calls and plan.call_format is not None:
            async for delta in self._free_until_calls(plan.call_format):
                yield delta
        else:
            async for delta in self._free_answer():
                yield delta

    async def _think(self) -> AsyncIterator[Delta]:
        fmt = self.plan.reasoning
        if self.plan.begins_in_reasoning is None:
            self._append(fmt.start + "\n")  # Qwen3 opens its block itself; open it so the constraint can wait
        budget = self.plan.max_reasoning_tokens
        params = {**self._free_params(), **self._stop_at(fmt.end)}
        splitter = ReasoningStream(fmt, True)
        async for text in self._request(params, limit=budget):
            reasoning, _ = splitter.feed(text)
            if reasoning:
                yield Delta("reasoning", reasoning)
        raw = self._text_before_stop()
        reasoning, _ = splitter.feed(raw, final=True)
        if reasoning:
            yield Delta("reasoning", reasoning)
        self.result.reasoning = splitter.reasoning or ""
        if self._stopped_at(fmt.end):
            self._continue_with(raw + fmt.end)
            self._append(AFTER_THINKING)
        elif self._reason() == "length" and self.remaining > 0:  # the reasoning budget is spent: close the block
            self._continue_with(raw)
            self._append("\n" + fmt.end + AFTER_THINKING)
        else:
            self._finish()
        if self.remaining <= 0 and not self.done:
            self.result.finish_reason, self.done = "length", True

    async def _free_answer(self) -> AsyncIterator[Delta]:
        plan = self.plan
        params = {**self.sampling, **plan.constraint} if plan.constraint else self._free_params()
        split = plan.reasoning is not None and not plan.thinks_first and plan.begins_in_reasoning is not False
        splitter = ReasoningStream(plan.reasoning, plan.reasoning.in_reasoning(plan.begins_in_reasoning)) \
            if split else None
        held = plan.pythonic  # a pythonic answer is a list of calls or content: known only at its end
        async for text in self._request(params):
            if held and not text.lstrip().startswith("[") and text.strip():
                held = False
            if not held:
                for delta in self._content(splitter, text):
                    yield delta
        text = self.last["text"]
        calls = parse_pythonic(text, plan.tools) if plan.pythonic else None
        if calls:
            for index, (name, arguments) in enumerate(calls):
                call = ToolCall(new_call_id(), name, arguments)
                self.result.calls.append(call)
                yield Delta("call", name, index, call.id)
                yield Delta("arguments", arguments, index)
            self.result.finish_reason = "tool_calls"
            self.done = True
            return
        for delta in self._content(splitter, text, final=True):
            yield delta
        self._finish()

    def _content(self, splitter: ReasoningStream | None, text: str, final: bool = False) -> list[Delta]:
        if splitter is None:
            new = text[len(self.result.content or ""):]
            self.result.content = text
            return [Delta("content", new)] if new else []
        reasoning, content = splitter.feed(text, final)
        self.result.reasoning = splitter.reasoning
        self.result.content = (self.result.content or "") + content
        return [d for d in (Delta("reasoning", reasoning), Delta("content", content)) if d.text]

    async def _free_until_calls(self, fmt: CallFormat) -> AsyncIterator[Delta]:
        params = {**self._free_params(), **self._trigger_stop(fmt)}
        sent = ""
        async for text in self._request(params):
            safe = self._safe_content(fmt, text)
            if len(safe) > len(sent) and safe.startswith(sent):
                yield Delta("content", safe[len(sent):])
                sent = safe
        if not self._triggered(fmt):
            tail = self.last["text"]
            if len(tail) > len(sent):
                yield Delta("content", tail[len(sent):])
            self.result.content = tail
            self._finish()
            return
        before = self._text_before_stop()
        if len(before) > len(sent) and before.strip():
            yield Delta("content", before[len(sent):])
        self.result.content = before if before.strip() else None
        self._continue_with(before)
        async for delta in self._calls():
            yield delta

    async def _calls(self) -> AsyncIterator[Delta]:
        fmt = self.plan.call_format
        self._append(fmt.open)
        for index in range(MAX_CALLS):
            async for delta in self._call(fmt, index):
                yield delta
            if self.done:
                return
            if not self.plan.parallel or index == MAX_CALLS - 1 or not await self._another_call(fmt):
                break
        self._append(fmt.close)
        self.result.finish_reason, self.result.matched_stop, self.done = "tool_calls", None, True

    async def _call(self, fmt: CallFormat, index: int) -> AsyncIterator[Delta]:
        names = self._candidates()
        self._append(fmt.prefix)
        if len(names) == 1:
            name = names[0]
            self._append(name)
        else:
            async for _ in self._request(self._constrained({"choices": names})):
                pass
            if self._reason() == "length":
                self._finish()
                return
            name = self.last["text"]
            self._continue_with(name)
        self._append(fmt.infix)
        tool = next(t for t in self.plan.tools if t.name == name)
        call = ToolCall(fmt.call_id(), name, "")
        sent = 0
        async for text in self._request(self._constrained({"json_schema": tool.parameters})):
            if sent == 0 and text:
                self.result.calls.append(call)
                yield Delta("call", name, index, call.id)
            if len(text) > sent:
                yield Delta("arguments", text[sent:], index)
                sent = len(text)
        arguments = self.last["text"]
        if sent == 0:
            self.result.calls.append(call)
            yield Delta("call", name, index, call.id)
        if len(arguments) > sent:
            yield Delta("arguments", arguments[sent:], index)
        self.result.calls[-1] = ToolCall(call.id, name, arguments)
        if self._reason() == "length":
            self._finish()
            return
        self._check_arguments(name, arguments)
        self._continue_with(arguments)
        self._append(fmt.suffix)

    async def _another_call(self, fmt: CallFormat) -> bool:
        """The model's choice between the next call (it writes the separator) and the end of the answer."""
        if self.remaining <= 0:
            return False
        async for _ in self._request(self._constrained({"regex": f"(?:{re.escape(fmt.separator)})?"})):
            pass
        more = self.last["text"] == fmt.separator
        if more:
            self._continue_with(fmt.separator)
        return more

    def _candidates(self) -> list[str]:
        if self.plan.choice.mode == "named":
            return [self.plan.choice.name]
        return [tool.name for tool in self.plan.tools]

    def _check_arguments(self, name: str, arguments: str) -> None:
        """The grammar path's own last check (schema_check) ran already; a failure here is the server's bug."""
        meta = self.last["meta_info"]
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            raise RuntimeError(f"the arguments generated for {name} are not JSON: {arguments!r}") from None
        if meta.get("schema_valid") is False:
            raise RuntimeError(f"the arguments generated for {name} violate its schema: "
                               f"{meta.get('schema_violation')}")
