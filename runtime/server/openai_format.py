"""Conversions between the OpenAI protocol and the engine's: sampling fields in, choices/logprobs/usage out."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..multimodal.content_parts import image_part, text_part
from .errors import ApiError
from .openai_protocol import ChatCompletionRequest, SamplingFields

# OpenAI field -> engine sampling field, for the fields that map one to one when given.
RENAMED = {"seed": "sampling_seed", "min_tokens": "min_new_tokens"}
PASSED = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
          "repetition_penalty", "stop_token_ids", "stop_regex", "ignore_eos", "skip_special_tokens", "no_stop_trim",
          "regex", "ebnf", "json_schema", "allow_approximate_schema", "seed", "min_tokens")


def engine_sampling(req: SamplingFields, max_new_tokens: int) -> dict[str, Any]:
    """The engine's sampling dict; fields left out keep the engine's defaults (temperature 1, as OpenAI's)."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    for name in PASSED:
        value = getattr(req, name)
        if value is not None:
            params[RENAMED.get(name, name)] = value
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        params.update(response_format_constraint(req))
    return params


def response_format_constraint(req: ChatCompletionRequest) -> dict[str, Any]:
    fmt = req.response_format
    if fmt.type == "text":
        return {}
    if req.regex is not None or req.ebnf is not None or req.json_schema is not None:
        raise ApiError(400, "response_format cannot be combined with regex, ebnf or json_schema")
    if fmt.type == "json_object":
        return {"json_schema": {"type": "object"}}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(400, "response_format of type json_schema needs json_schema.schema")
    return {"json_schema": fmt.json_schema.schema_}


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def matched_stop(meta: dict[str, Any]) -> Any:
    return (meta.get("finish_reason") or {}).get("matched")


def completion_logprobs(entries: list, tops: list | None, offset: int) -> dict[str, Any]:
    """OpenAI's legacy completion logprobs; `offset` is where the first token's text starts in the choice text."""
    tokens, offsets = [], []
    for _, _, text in entries:
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [None if t is None else {text: lp for lp, _, text in t} for t in tops] if tops is not None else None
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": top if top is not None else [None] * len(entries), "text_offset": offsets}


def chat_logprobs(entries: list, tops: list | None) -> dict[str, Any]:
    content = []
    for index, (lp, _, text) in enumerate(entries):
        top = tops[index] if tops is not None and index < len(tops) and tops[index] is not None else []
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace")),
                        "top_logprobs": [{"token": t, "logprob": tlp, "bytes": list(t.encode("utf-8", "replace"))}
                                         for tlp, _, t in top]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(kind: str, rid: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, **fields}


def message_text(content: Any, image_placeholder: str = "") -> str:
    """A message's text; an image part becomes the model's image placeholder, where it stood."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text if part.type == "text" else image_placeholder for part in content)


def message_parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as HF's content parts, which a vision-language model's chat template reads: a text part
    for its text, an image part for each image_url part, where it stood."""
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(content)]
    return [text_part(part.text) if part.type == "text" else image_part() for part in content]


def message_images(content: Any) -> list[str]:
    """The image URLs of a message's parts, in order."""
    return [part.image_url.url for part in content if part.type == "image_url"] if isinstance(content, list) else []
