"""The engine requests of an answer's parts (server/answer.py), and the token ids each continues.

A part continues the ids of the prompt and the parts before it: a generated part's own tokens as far as they spell
the text kept of it, then the tokens of any text the format fixes. Its stop (a trigger, the end of a think block)
is a stop token when that text is one token of the vocabulary, else a stop string. Each part's completion tokens
count against the answer's limit; its logprobs, when asked for, are the answer's in order.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import Engine
from ..tools.formats import CallFormat
from ..tools.protocol import ToolCall
from ..tools.reasoning import partial_tag

# Free-text fields a constrained part must not carry: a stop string inside JSON would cut it, ignore_eos would
# run on after the grammar has ended.
FREE_ONLY = ("stop", "stop_regex", "stop_token_ids", "ignore_eos", "min_new_tokens")


@dataclass
class AnswerResult:
    content: str | None = None
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: Any = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    # The generated tokens' [logprob, id, text] entries and top alternatives, over all parts (text the format fixes
    # has none).
    logprobs: list[Any] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)


class Aborted(Exception):
    """A part was aborted (/abort_request with the request's rid): the answer ends there."""


class PartRequests:
    def __init__(self, engine: Engine, prompt_ids: list[int], limit: int, sampling: dict[str, Any], stream: bool,
                 top_logprobs: int | None, images: list[Any] | None, rid: str | None) -> None:
        self.engine, self.stream = engine, stream
        self.rid = rid  # each part is `<rid>-<part>`: aborting the rid aborts the part running (Engine.abort)
        self.images = images  # every part's ids hold the prompt's image placeholders: each request sends the images
        self.ids = list(prompt_ids)
        self.remaining = limit
        self.sampling = sampling
        self.logprob_args = {} if top_logprobs is None else {
            "return_logprob": True, "top_logprobs_num": top_logprobs, "return_text_in_logprobs": True}
        self.result = AnswerResult()
        self.requests = 0
        self.last: dict[str, Any] = {}
        self.done = False  # the answer ended (self.result says how)
        self.logprobs_sent = 0

    def new_logprobs(self) -> tuple[list[Any], list[Any]]:
        """The logprob entries (and their top alternatives) gathered since the last call."""
        start, self.logprobs_sent = self.logprobs_sent, len(self.result.logprobs)
        return self.result.logprobs[start:], self.result.top_logprobs[start:]

    async def _request(self, params: dict[str, Any], limit: int | None = None) -> AsyncIterator[str]:
        """One part: yields its cumulative text; `self.last` is its final result."""
        budget = self.remaining if limit is None else min(limit, self.remaining)
        if budget <= 0:  # the answer's token budget is spent: this part ends at once, at its length
            self.last = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length"},
                                                                     "completion_tokens": 0, "cached_tokens": 0}}
            yield ""
            return
        sampling = {**params, "max_new_tokens": budget}
        rid = None if self.rid is None else f"{self.rid}-{self.requests}"
        if self.stream:
            chunks = await self.engine.async_generate(input_ids=self.ids, sampling_params=sampling, stream=True,
                                                      rid=rid, image_data=self.images, **self.logprob_args)
            try:
                async for chunk in chunks:
                    self.last = chunk
                    self._gather_logprobs(chunk["meta_info"])  # a streamed chunk carries its new entries
                    yield chunk["text"]
            finally:
                await chunks.aclose()
        else:
            self.last = await self.engine.async_generate(input_ids=self.ids, sampling_params=sampling, rid=rid,
                                                         image_data=self.images, **self.logprob_args)
            self._gather_logprobs(self.last["meta_info"])
            yield self.last["text"]
        meta = self.last["meta_info"]
        if not self.requests:  # the prompt's own cache hits; later parts hit what earlier ones wrote
            self.result.cached_tokens = meta["cached_tokens"]
        self.requests += 1
        self.result.completion_tokens += meta["completion_tokens"]
        self.remaining -= meta["completion_tokens"]
        if meta["finish_reason"]["type"] == "abort":
            self._finish()
            raise Aborted

    def _gather_logprobs(self, meta: dict[str, Any]) -> None:
        entries = meta.get("output_token_logprobs") or []
        self.result.logprobs += entries
        self.result.top_logprobs += meta.get("output_top_logprobs") or [None] * len(entries)

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
        return text[:cut] if cut >= 0 else text[:len(text) - partial_tag(text, fmt.trigger)]

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
