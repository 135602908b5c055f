"""One chat answer built from several engine requests, so each part gets the constraint it needs.

A reasoning model thinks freely until `</think>`; the answer after it may follow a JSON schema. A tool call's name is
one of the functions' names, its arguments follow that function's parameter schema, and the text around them is
the call format's own (tools/formats.py). Each of those parts is one engine request that continues the token ids of
the parts before it, so the radix cache holds the shared prefix and each request prefills only the few tokens of
the text appended since; each constraint goes through the grammar path unchanged (exactness, compile cache,
allow_approximate_schema). Free text ends at a trigger: a stop token when the trigger is one token of the
vocabulary, else a stop string (a stop regex anchored at the start for formats whose calls start the answer).

`Answer.run()` yields `Delta`s as the parts produce text; `Answer.result` holds the whole answer afterwards.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine
from ..reasoning import ReasoningFormat, ReasoningStream
from ..tools.formats import CallFormat
from ..tools.protocol import ToolCall, ToolChoice, ToolFunction, new_call_id
from ..tools.pythonic import parse_pythonic

CONSTRAINTS = ("json_schema", "regex", "ebnf")
# Free-text fields a constrained part must not carry: a stop string inside JSON would cut it, ignore_eos would
# run on after the grammar has ended.
FREE_ONLY = ("stop", "stop_regex", "stop_token_ids", "ignore_eos", "min_new_tokens")
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

    @property
    def thinks_first(self) -> bool:
        """The think block is its own part when a constrained part follows it."""
        return (self.reasoning is not None and self.begins_in_reasoning is not False
                and bool(self.constraint or self.choice.calls))


@dataclass
class AnswerResult:
    content: str | None = None
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: Any = None
    completion_tokens: int = 0
    cached_tokens: int = 0


class Answer:
    def __init__(self, engine: Engine, plan: AnswerPlan, stream: bool, seed_offset: int = 0) -> None:
        self.engine, self.plan, self.stream = engine, plan, stream
        self.ids = list(plan.prompt_ids)
        self.requests = 0
        self.remaining = plan.limit
        self.result = AnswerResult()
        self.sampling = dict(plan.sampling, n=1)
        if "sampling_seed" in self.sampling:
            self.sampling["sampling_seed"] += seed_offset
        self.last: dict[str, Any] = {}
        self.done = False  # the answer ended (self.result says how)

    # -- the parts --------------------------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[Delta]:
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

    # -- engine requests and the token ids they continue ------------------------------------------------------

    async def _request(self, params: dict[str, Any], limit: int | None = None) -> AsyncIterator[str]:
        """One part: yields its cumulative text; `self.last` is its final result."""
        budget = self.remaining if limit is None else min(limit, self.remaining)
        if budget <= 0:  # the answer's token budget is spent: this part ends at once, at its length
            self.last = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length"},
                                                                     "completion_tokens": 0, "cached_tokens": 0}}
            yield ""
            return
        sampling = {**params, "max_new_tokens": budget}
        if self.stream:
            chunks = await self.engine.async_generate(input_ids=self.ids, sampling_params=sampling, stream=True)
            try:
                async for chunk in chunks:
                    self.last = chunk
                    yield chunk["text"]
            finally:
                await chunks.aclose()
        else:
            self.last = await self.engine.async_generate(input_ids=self.ids, sampling_params=sampling)
            yield self.last["text"]
        meta = self.last["meta_info"]
        if not self.requests:  # the prompt's own cache hits; later parts hit what earlier ones wrote
            self.result.cached_tokens = meta["cached_tokens"]
        self.requests += 1
        self.result.completion_tokens += meta["completion_tokens"]
        self.remaining -= meta["completion_tokens"]

    def _free_params(self) -> dict[str, Any]:
        return dict(self.sampling)

    def _constrained(self, constraint: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in self.sampling.items() if k not in FREE_ONLY}, **constraint}

    def _stop_at(self, text: str) -> dict[str, Any]:
        """Stop when the model writes `text`: on its token when it is one token of the vocabulary."""
        token = self._single_token(text)
        if token is not None:
            return {"stop_token_ids": [*self.sampling.get("stop_token_ids", []), token]}
        return {"stop": [*_as_list(self.sampling.get("stop")), text]}

    def _trigger_stop(self, fmt: CallFormat) -> dict[str, Any]:
        if fmt.trigger_at_start:
            return {"stop_regex": [*_as_list(self.sampling.get("stop_regex")), r"^\s*" + re.escape(fmt.trigger)]}
        return self._stop_at(fmt.trigger)

    @staticmethod
    def _safe_content(fmt: CallFormat, text: str) -> str:
        """The part of free text that is content for sure: none of the trigger, nor what may still become it."""
        if fmt.trigger_at_start:
            return "" if not text.strip() or text.lstrip().startswith(fmt.trigger) else text
        cut = text.find(fmt.trigger)
        if cut >= 0:
            return text[:cut]
        trigger = fmt.trigger
        held = next((k for k in range(min(len(trigger) - 1, len(text)), 0, -1) if text.endswith(trigger[:k])), 0)
        return text[:len(text) - held]

    def _single_token(self, text: str) -> int | None:
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.engine.tokenizer.decode(ids) == text else None

    def _reason(self) -> str:
        return self.last["meta_info"]["finish_reason"]["type"]

    def _matched(self) -> Any:
        return self.last["meta_info"]["finish_reason"].get("matched")

    def _stopped_at(self, text: str) -> bool:
        matched = self._matched()
        return self._reason() == "stop" and (matched == text or matched == self._single_token(text))

    def _triggered(self, fmt: CallFormat) -> bool:
        if fmt.trigger_at_start:
            matched = self._matched()
            return isinstance(matched, str) and re.fullmatch(r"\s*" + re.escape(fmt.trigger), matched) is not None
        return self._stopped_at(fmt.trigger)

    def _text_before_stop(self) -> str:
        """The last part's text without the stop that ended it: the engine cuts a stop string off its text; a
        stop token's text is left out here."""
        if self._reason() == "stop" and isinstance(self._matched(), int):
            return self._decode(self.last["output_ids"][:-1])
        return self.last["text"]

    def _finish(self) -> None:
        reason = self.last["meta_info"]["finish_reason"]
        self.result.finish_reason = reason["type"]
        self.result.matched_stop = reason.get("matched")
        self.done = True

    def _append(self, text: str) -> None:
        """Text the format fixes: appended to the ids the next part continues, never generated."""
        if text:
            self.ids = self.ids + self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _continue_with(self, kept: str) -> None:
        """Continue after the last part's output cut to the text `kept`: its own tokens as far as they spell a
        prefix of `kept` (no stop token), the rest tokenized."""
        ids = list(self.last["output_ids"])
        if ids and self._reason() == "stop" and ids[-1] == self._matched():
            stop_text = self._decode(ids[-1:])
            if not stop_text or not kept.endswith(stop_text):  # the model's end-of-turn token
                ids.pop()
        while ids and not kept.startswith(self._decode(ids)):
            ids.pop()
        self.ids = self.ids + ids
        self._append(kept[len(self._decode(ids)):] if ids else kept)

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)
