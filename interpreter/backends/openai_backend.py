"""Any OpenAI-compatible API, through the official `openai` client (AsyncOpenAI).

How programs map onto the API:
- A program without roles sends its text to /v1/completions. A program with roles sends its conversation as
  `messages` to /v1/chat/completions; there a gen must open the assistant's turn (`sgl.assistant(sgl.gen(...))`),
  since the API cannot continue a half-written assistant message or write outside the assistant's turn.
  The text of a program with roles uses ChatML markers (`<|im_start|>user\\n...<|im_end|>\\n`); the server
  applies the model's own template to the messages.
- `select` on a completions prompt scores every choice by its prompt logprobs (one /v1/completions request with
  echo and logprobs), the way the runtime backends do, so every choices method works except
  unconditional_likelihood_normalized (it needs token ids the API does not give). On a chat prompt there are no
  prompt logprobs: the server picks the choice greedily under a constraint (a regex with
  `server_extensions=True`, else a JSON schema with an enum through `response_format`) and the chosen choice
  gets logprob 0, the others -inf, whatever the choices method.
- `json_schema` gens go through `response_format` on chat prompts. regex, ebnf, json_schema on completions
  prompts and the runtime's sampling fields the OpenAI API lacks (top_k, min_p, ignore_eos, stop_regex,
  stop_token_ids, min_new_tokens, repetition_penalty, ...) are sent in the request body only with
  `server_extensions=True` (a furcate or SGLang server takes them); otherwise using them is an error naming the
  feature.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...grammars.spec import ANY_JSON
from ...lang.choices import ChoiceScores
from ..chat_template import ChatTemplate
from .base import Backend, choice_starts, wire_sampling
from .image_wire import REMOTE_FORMS, wire_image
from .jinja_template import JinjaTemplateTokenizer
from .per_loop import PerLoop

ROLE_START = "<|im_start|>"
IMAGE_MARKER = "<|furcate_image|>"  # where an image stands in a prompt; sent as an image_url part
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.DOTALL)
OPEN_ASSISTANT = "<|im_start|>assistant\n"

# The runtime's sampling fields that the OpenAI API has, under OpenAI's names.
OPENAI_FIELDS = {"n": "n", "stop": "stop", "temperature": "temperature", "top_p": "top_p",
                 "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                 "sampling_seed": "seed", "logit_bias": "logit_bias"}
# The runtime's fields the OpenAI API lacks, with the value that leaves them off (then they are not sent), under
# the name a furcate/SGLang server's OpenAI routes take them by.
EXTENSION_FIELDS = {"top_k": (-1, "top_k"), "min_p": (0.0, "min_p"), "ignore_eos": (False, "ignore_eos"),
                    "repetition_penalty": (1.0, "repetition_penalty"), "min_new_tokens": (0, "min_tokens"),
                    "stop_token_ids": (None, "stop_token_ids"), "stop_regex": (None, "stop_regex"),
                    "skip_special_tokens": (True, "skip_special_tokens"), "no_stop_trim": (False, "no_stop_trim"),
                    "regex": (None, "regex"), "ebnf": (None, "ebnf"), "json_schema": (None, "json_schema")}
FINISH_REASONS = {"stop": "stop", "length": "length"}
REGEX_SPECIALS = set("\\.^$*+?{}[]|()")


class OpenAI(Backend):
    """`OpenAI(model_name, base_url=None, api_key=None, server_extensions=False, **client_args)`.

    `api_key` defaults to $OPENAI_API_KEY (a server of one's own at `base_url` may need none); `client_args` go to
    `openai.AsyncOpenAI` (timeout, max_retries, default_headers, ...). `server_extensions=True` says the server
    also takes SGLang's extra sampling fields (regex, ebnf, top_k, ...), as furcate's and SGLang's do.
    """

    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 server_extensions: bool = False, **client_args: Any) -> None:
        import openai

        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if api_key is None:
            if base_url is None:
                raise ValueError("OpenAI needs an API key: pass api_key=... or set OPENAI_API_KEY")
            api_key = "EMPTY"  # the client insists on one; a server of one's own without a key ignores it
        self.model_name = model_name
        self.server_extensions = server_extensions
        self._clients: PerLoop[Any] = PerLoop(
            lambda: openai.AsyncOpenAI(api_key=api_key, base_url=base_url, **client_args), lambda c: c.close())
        self._template = ChatTemplate(JinjaTemplateTokenizer(CHATML))

    def __repr__(self) -> str:
        return f"OpenAI({self.model_name!r})"

    def chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def image_placeholder(self) -> str:
        """A marker in the prompt text; each becomes an image_url part of its chat message (chat roles only)."""
        return IMAGE_MARKER

    def close(self) -> None:
        self._clients.close_all()

    # -- gen --------------------------------------------------------------------------------------------------

    async def generate(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                       **logprob_args: Any) -> dict | list[dict]:
        chat, kwargs = self._request(prompt, sampling, logprob_args, images)
        client = self._clients.get()
        if chat:
            response = await client.chat.completions.create(**kwargs)
        else:
            response = await client.completions.create(**kwargs)
        results = [result(choice, response, chat) for choice in sorted(response.choices, key=lambda c: c.index)]
        return results if sampling.get("n", 1) > 1 else results[0]

    async def generate_stream(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                              **logprob_args: Any) -> AsyncIterator[dict]:
        chat, kwargs = self._request(prompt, sampling, logprob_args, images)
        client = self._clients.get()
        create = client.chat.completions.create if chat else client.completions.create
        stream = await create(**kwargs, stream=True, stream_options={"include_usage": True})
        text, meta, finished = "", {"finish_reason": None}, None
        async for chunk in stream:
            meta["id"] = chunk.id
            if chunk.usage is not None:  # the last chunk, after the one that finished
                meta.update(usage_meta(chunk.usage))
            for choice in chunk.choices:
                delta = (choice.delta.content if chat else choice.text) or ""
                text += delta
                finished = choice if choice.finish_reason is not None else finished
                if delta:  # logprob lists carry this chunk's new entries only, as the native stream's do
                    yield {"text": text, "meta_info": {**meta, **logprob_meta(choice.logprobs, chat)}}
        # The last word, once the token counts are known: the finish reason.
        yield {"text": text, "meta_info": {**meta, "finish_reason": finished and finish_reason(finished, meta)}}

    def _request(self, prompt: str, sampling: dict[str, Any], logprob_args: dict[str, Any],
                 images: Sequence[Any] = ()) -> tuple[bool, dict]:
        """Whether the prompt goes to the chat route, and the create() keywords for it."""
        chat = ROLE_START in prompt
        sampling = wire_sampling(sampling)
        kwargs: dict[str, Any] = {"model": self.model_name}
        if chat:
            kwargs["messages"] = with_images(chat_messages(prompt, "a gen"), images)
        elif images:
            raise ValueError("on an OpenAI API, images go in chat messages: put sgl.image(...) inside a role")
        else:
            kwargs["prompt"] = prompt
        if "max_new_tokens" in sampling:
            kwargs["max_completion_tokens" if chat else "max_tokens"] = sampling["max_new_tokens"]
        kwargs.update({OPENAI_FIELDS[k]: v for k, v in sampling.items() if k in OPENAI_FIELDS and v is not None})
        constraint = sampling.get("json_schema")
        if chat and constraint is not None:
            kwargs["response_format"] = response_format(constraint)
            sampling = {k: v for k, v in sampling.items() if k != "json_schema"}
        extra = self._extensions(sampling)
        if extra:
            kwargs["extra_body"] = extra
        kwargs.update(openai_logprob_args(logprob_args, chat))
        return chat, kwargs

    def _extensions(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """The runtime's fields the OpenAI API lacks, set to something other than off: sent with
        server_extensions, an error without."""
        extra = {}
        for key, value in sampling.items():
            if key in OPENAI_FIELDS or key == "max_new_tokens":
                continue
            if key not in EXTENSION_FIELDS:
                raise ValueError(f"the sampling field {key!r} has no equivalent in the OpenAI API")
            off, name = EXTENSION_FIELDS[key]
            if value is None or value == off or value == []:
                continue
            if not self.server_extensions:
                raise ValueError(f"{key} is not part of the OpenAI API; a furcate or SGLang server takes it when the "
                                 f"backend is OpenAI(..., server_extensions=True)")
            extra[name] = value
        return extra

    # -- select -----------------------------------------------------------------------------------------------

    async def score_choices(self, prompt: str, choices: list[str], unconditional: bool,
                            images: Sequence[Any] = ()) -> list[ChoiceScores]:
        if ROLE_START in prompt:
            return await self._constrained_choice(prompt, choices, unconditional, images)
        if images:
            raise ValueError("on an OpenAI API, images go in chat messages: put sgl.image(...) inside a role")
        if unconditional:
            raise ValueError("unconditional_likelihood_normalized needs each choice scored after the start token "
                             "alone, which the OpenAI API cannot express; use token_length_normalized or "
                             "greedy_token_selection")
        return await self._echo_scores(prompt, choices)

    async def _echo_scores(self, prompt: str, choices: list[str]) -> list[ChoiceScores]:
        """Prompt logprobs of prompt+choice for every choice (and the prompt alone, to see where each choice's
        tokens start), in one echo request that generates nothing."""
        texts = ([prompt] if prompt else []) + [prompt + choice for choice in choices]
        response = await self._clients.get().completions.create(
            model=self.model_name, prompt=texts, max_tokens=0, echo=True, logprobs=0, temperature=0)
        rows = [c.logprobs for c in sorted(response.choices, key=lambda c: c.index)]
        if any(row is None or row.token_logprobs is None for row in rows):
            raise ValueError("select scores choices by prompt logprobs, and this API returned none for echo=True "
                             "with logprobs")
        prompt_tokens = rows[0].tokens if prompt else []
        choice_rows = rows[1:] if prompt else rows
        starts = choice_starts(prompt_tokens, [row.tokens for row in choice_rows])
        return [ChoiceScores([lp for lp in row.token_logprobs[start:] if lp is not None])
                for row, start in zip(choice_rows, starts)]

    async def _constrained_choice(self, prompt: str, choices: list[str], unconditional: bool,
                                  images: Sequence[Any] = ()) -> list[ChoiceScores]:
        """The server's greedy pick among the choices, decoded under a constraint that allows only them."""
        kwargs: dict[str, Any] = {"model": self.model_name, "temperature": 0,
                                  "messages": with_images(chat_messages(prompt, "a select"), images)}
        longest = max(len(choice.encode()) for choice in choices)  # a token is at least one byte
        if self.server_extensions:
            kwargs["extra_body"] = {"regex": "(" + "|".join(map(escape_regex, choices)) + ")"}
            kwargs["max_completion_tokens"] = longest + 1
        else:
            kwargs["response_format"] = response_format(json.dumps(choice_schema(choices)))
            kwargs["max_completion_tokens"] = 2 * longest + 64  # room for the JSON around it, and its escapes
        response = await self._clients.get().chat.completions.create(**kwargs)
        text = response.choices[0].message.content or ""
        picked = text if self.server_extensions else parse_choice(text)
        if picked not in choices:
            raise ValueError(f"the server answered {text!r} to a select constrained to {choices}")
        return [ChoiceScores([0.0 if choice == picked else -math.inf], [0.0] if unconditional else None)
                for choice in choices]

    # -- the rest of the protocol -----------------------------------------------------------------------------

    async def cache_prefix(self, prompt: str, images: Sequence[Any] = ()) -> None:
        """Nothing to do: an OpenAI-compatible server caches prompt prefixes by itself, if it does at all."""

    def get_server_info(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "server_extensions": self.server_extensions}


def chat_messages(prompt: str, what: str) -> list[dict[str, str]]:
    """The conversation of a chat prompt whose assistant turn is open and empty (what the chat API completes)."""
    messages, pos = [], 0
    while match := TURN.match(prompt, pos):
        messages.append({"role": match[1], "content": match[2]})
        pos = match.end()
    rest = prompt[pos:]
    if not rest.startswith(OPEN_ASSISTANT):
        where = "after the last role" if pos and not rest.startswith(ROLE_START) else "outside the assistant's turn"
        raise ValueError(f"on an OpenAI chat API, {what} must open the assistant's turn (sgl.assistant(...)); this "
                         f"one is {where}, and text outside roles cannot be sent as chat messages")
    if rest != OPEN_ASSISTANT:
        partial = rest[len(OPEN_ASSISTANT):]
        raise ValueError(f"on an OpenAI chat API, {what} must come first in the assistant's turn: the API cannot "
                         f"continue the assistant message already begun ({partial[:40]!r})")
    return messages


def with_images(messages: list[dict[str, Any]], images: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages whose text holds image markers as content parts: text, then each image as an image_url part
    (a data: URL, as OpenAI's API takes an image), in the order the program showed them."""
    if not images:
        return messages
    remaining = list(images)
    parted = []
    for message in messages:
        pieces = message["content"].split(IMAGE_MARKER)
        if len(pieces) == 1:
            parted.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image_url", "image_url": {"url": image_url(remaining.pop(0))}})
            if piece:
                parts.append({"type": "text", "text": piece})
        parted.append({**message, "content": parts})
    return parted


def image_url(source: Any) -> str:
    wired = wire_image(source)
    return wired if wired.startswith(REMOTE_FORMS) else f"data:image/png;base64,{wired}"


def response_format(json_schema: str) -> dict[str, Any]:
    if json_schema == ANY_JSON:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(json_schema)}}


def choice_schema(choices: list[str]) -> dict[str, Any]:
    # An object around the enum: OpenAI's structured outputs take only an object at the top.
    return {"type": "object", "properties": {"choice": {"type": "string", "enum": choices}},
            "required": ["choice"], "additionalProperties": False}


def parse_choice(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value.get("choice") if isinstance(value, dict) else None


def escape_regex(text: str) -> str:
    """Escape only the regex operators: grammar engines refuse Python's escapes of plain characters like `\\ `."""
    return "".join("\\" + ch if ch in REGEX_SPECIALS else ch for ch in text)


def openai_logprob_args(logprob_args: dict[str, Any], chat: bool) -> dict[str, Any]:
    """return_logprob / top_logprobs_num as the API's logprobs fields; prompt logprobs have no equivalent."""
    if not logprob_args.get("return_logprob"):
        return {}
    if logprob_args.get("logprob_start_len", -1) not in (-1, None):
        raise ValueError("prompt logprobs (logprob_start_len) are not part of the OpenAI API; only the generated "
                         "tokens' logprobs are")
    top = logprob_args.get("top_logprobs_num") or 0
    if chat:
        return {"logprobs": True, **({"top_logprobs": top} if top else {})}
    return {"logprobs": top}


def result(choice: Any, response: Any, chat: bool) -> dict[str, Any]:
    """One choice of a response as the runtime's result dict: text and meta_info."""
    text = (choice.message.content if chat else choice.text) or ""
    meta: dict[str, Any] = {"id": response.id, **usage_meta(response.usage), **logprob_meta(choice.logprobs, chat)}
    meta["finish_reason"] = finish_reason(choice, meta)
    return {"text": text, "meta_info": meta}


def usage_meta(usage: Any) -> dict[str, Any]:
    """Token counts (over all n samples: the API counts them together)."""
    if usage is None:
        return {}
    details = getattr(usage, "prompt_tokens_details", None)
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details is not None else 0}


def finish_reason(choice: Any, meta: dict[str, Any]) -> dict[str, Any] | None:
    reason = choice.finish_reason
    if reason is None:
        return None
    kind = FINISH_REASONS.get(reason, reason)
    if kind == "length":
        return {"type": "length", "length": meta.get("completion_tokens")}
    return {"type": kind, "matched": getattr(choice, "matched_stop", None)}


def logprob_meta(logprobs: Any, chat: bool) -> dict[str, Any]:
    """The generated tokens' logprobs as the runtime's [logprob, token_id, text] entries (ids: unknown, None)."""
    if logprobs is None:
        return {}
    if chat:
        content = logprobs.content or []
        entries = [[c.logprob, None, c.token] for c in content]
        tops = [[[t.logprob, None, t.token] for t in c.top_logprobs] for c in content]
    else:
        entries = [[lp, None, token] for lp, token in zip(logprobs.token_logprobs or [], logprobs.tokens or [])]
        tops = [[[lp, None, token] for token, lp in (top or {}).items()] for top in (logprobs.top_logprobs or [])]
    meta: dict[str, Any] = {"output_token_logprobs": entries}
    if any(tops):
        meta["output_top_logprobs"] = tops
    return meta
