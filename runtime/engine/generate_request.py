"""One generate call as one typed value: the SGLang keywords of Engine.generate and async_generate, checked and
normalized as the call is made, before anything is tokenized or sent. The request builder turns it into scheduler
requests; what needs the model (vocabulary, context length, images, disaggregation mode) is checked there."""

from __future__ import annotations

import numbers
import threading
from collections.abc import AsyncGenerator, Generator, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any, TypedDict

# Requests one call may create (prompts times n): a bound, so no call can queue without limit.
MAX_REQUESTS_PER_CALL = 8192
BOOTSTRAP_KEYWORDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

Output = dict[str, Any]  # one result or one streamed chunk: text, output_ids and meta_info
Chunks = Generator[Output, None, None]  # a sync stream: close() it to stop early (the request is aborted)
AsyncChunks = AsyncGenerator[Output, None]  # an async stream: aclose() it to stop early
SamplingArg = dict[str, Any] | list[dict[str, Any]] | None  # one dict for every prompt, or one per prompt


@dataclass(frozen=True)
class BootstrapFields:
    """Disaggregated serving: where a request's prefill and decode halves pair up, as sglang-router sends it.
    The values stay as given: whether they are needed, and what they may be, depends on the server's
    disaggregation_mode, which only the request builder knows."""

    host: Any = None
    port: Any = None
    room: Any = None

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> BootstrapFields | None:
        """SGLang's bootstrap_host, bootstrap_port and bootstrap_room keywords; None when none has a value."""
        unknown = sorted(set(keywords) - set(BOOTSTRAP_KEYWORDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        fields = cls(*(keywords.get(name) for name in BOOTSTRAP_KEYWORDS))
        return fields if fields.given() else None

    def given(self) -> dict[str, Any]:
        """The fields that have a value, by their SGLang names."""
        values = dict(zip(BOOTSTRAP_KEYWORDS, (self.host, self.port, self.room)))
        return {name: value for name, value in values.items() if value is not None}


def bootstrap_of(bootstrap: BootstrapFields | None, keywords: Mapping[str, Any]) -> BootstrapFields | None:
    """The typed `bootstrap` argument, or SGLang's bootstrap_* keywords collected into one; never both."""
    collected = BootstrapFields.from_keywords(keywords)
    if bootstrap is not None and collected is not None:
        raise ValueError("pass either bootstrap or the bootstrap_host/port/room keywords, not both")
    return collected if bootstrap is None else bootstrap


class GenerateOptions(TypedDict, total=False):
    """The keywords generate and async_generate take besides prompt, sampling_params, input_ids and stream."""

    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    rid: str | None
    timeout: float | None
    image_data: Any
    bootstrap: BootstrapFields | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None


@dataclass(frozen=True)
class GenerateRequest:
    """The arguments of one generate call, by SGLang's names and with its defaults; building one checks them, and a
    wrong type, a list where a string belongs, NaN or a size past a limit is a ValueError naming the argument.
    The prompts are kept as `texts` (prompt given) or `token_ids` (input_ids given); `single` tells a lone prompt
    (one result) from a list of them."""

    prompt: InitVar[str | list[str] | None] = None
    sampling_params: SamplingArg = None
    input_ids: InitVar[list[int] | list[list[int]] | None] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None
    timeout: float | None = None
    image_data: Any = None
    bootstrap: BootstrapFields | None = None
    texts: tuple[str, ...] | None = field(init=False)
    token_ids: tuple[tuple[int, ...], ...] | None = field(init=False)
    single: bool = field(init=False)

    def __post_init__(self, prompt: Any, input_ids: Any) -> None:
        _check_timeout(self.timeout, self.stream)
        _check_flags(return_logprob=self.return_logprob, stream=self.stream,
                     return_text_in_logprobs=self.return_text_in_logprobs)
        if self.rid is not None and (not isinstance(self.rid, str) or not self.rid):
            raise ValueError(f"rid must be a non-empty string, got {self.rid!r}")
        if self.top_logprobs_num and not self.return_logprob:
            raise ValueError("top_logprobs_num needs return_logprob=True")
        self._set_prompts(prompt, input_ids)
        _check_logprob_args(self.logprob_start_len, self.top_logprobs_num)
        if self.bootstrap is not None and not isinstance(self.bootstrap, BootstrapFields):
            raise ValueError(f"bootstrap must be a BootstrapFields, got {type(self.bootstrap).__name__}")

    def _set_prompts(self, prompt: Any, input_ids: Any) -> None:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt (text) or input_ids")
        texts, token_ids = None, None
        if prompt is not None:
            texts, single = _texts(prompt)
        else:
            token_ids, single = _token_ids(input_ids)
        count = len(texts or token_ids or ())
        if count > MAX_REQUESTS_PER_CALL:  # before any of them is tokenized
            raise ValueError(f"one call may create at most {MAX_REQUESTS_PER_CALL} requests (prompts times n), "
                             f"got {count} prompts")
        # frozen: the checked values are set once, here
        object.__setattr__(self, "texts", texts)
        object.__setattr__(self, "token_ids", token_ids)
        object.__setattr__(self, "single", single)


def _texts(prompt: Any) -> tuple[tuple[str, ...], bool]:
    single = isinstance(prompt, str)
    if not single and not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt must be a string or a non-empty list of strings, got {type(prompt).__name__}")
    texts = (prompt,) if single else tuple(prompt)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("prompt must be a string or a non-empty list of strings")
    for index, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"prompt {'' if single else index} is not valid text: {error.reason} at "
                             f"position {error.start}") from None
    for index, text in enumerate(texts):
        if not text:
            raise ValueError("prompt is empty" if single else f"prompt {index} is empty")
    return texts, single


def _token_ids(input_ids: Any) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """Token id lists; an id's range is the request builder's check (it knows the vocabulary)."""
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError(f"input_ids must be a list of token ids or a list of such lists, got "
                         f"{type(input_ids).__name__}")
    single = bool(input_ids) and all(is_token_id(t) for t in input_ids)
    lists = [input_ids] if single else list(input_ids)
    if not lists or not all(isinstance(ids, (list, tuple)) and ids for ids in lists):
        raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")
    for ids in lists:
        bad = [t for t in ids if not is_token_id(t)]
        if bad:
            raise ValueError(f"input_ids must hold integer token ids, got {bad[:5]}")
    return tuple(tuple(int(t) for t in ids) for ids in lists), single


def _check_timeout(timeout: Any, stream: Any) -> None:
    """None: wait as long as it takes. Past threading.TIMEOUT_MAX no thread can wait, so such a value is refused
    here rather than failing as an OverflowError once the request runs."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= threading.TIMEOUT_MAX:
        raise ValueError(f"timeout must be a positive number of seconds (at most {threading.TIMEOUT_MAX:.0f}), "
                         f"got {timeout!r}")
    if stream:
        raise ValueError("timeout applies to whole results; a stream's reader decides when to stop")


def _check_logprob_args(logprob_start_len: Any, top_logprobs_num: Any) -> None:
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < -1:
        raise ValueError(f"logprob_start_len must be an integer >= -1, got {logprob_start_len!r}")
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")


def _check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")


def is_token_id(value: Any) -> bool:
    """Python and numpy integers, not bools (True is not token 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
