"""The in-process backend: a furcate Engine, through its public async API only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..chat_template import ChatTemplate
from .base import TokenScoringBackend, first_special_id


class LocalBackend(TokenScoringBackend):
    """`LocalBackend(engine, chat_template=None)`; `chat_template` (a Jinja string) overrides the model's."""

    def __init__(self, engine: Any, chat_template: str | None = None) -> None:
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template must be a Jinja template string")
        self.engine = engine
        self._template = ChatTemplate(engine.tokenizer, chat_template)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def image_placeholder(self) -> str | None:
        return self.engine.image_placeholder

    @property
    def image_tokens(self) -> int | None:
        return self.engine.image_tokens

    async def generate(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                       **logprob_args: Any) -> dict | list[dict]:
        return await self.engine.async_generate(prompt, sampling, image_data=_image_data(images), **logprob_args)

    async def generate_stream(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                              **logprob_args: Any) -> AsyncIterator[dict]:
        chunks = await self.engine.async_generate(prompt, sampling, stream=True, image_data=_image_data(images),
                                                  **logprob_args)
        async for chunk in chunks:
            yield chunk

    async def encode(self, texts: list[str]) -> list[list[int]]:
        # On a worker thread: every program shares this loop, and fast tokenizers release the GIL.
        return await asyncio.to_thread(lambda: [self.tokenizer.encode(text) for text in texts])

    async def prefill_logprobs(self, input_ids: list[list[int]], logprob_start_len: int,
                               images: Sequence[Any] = ()) -> list[dict]:
        per_row = [list(images) for _ in input_ids] if images else None
        return await self.engine.async_generate(input_ids=input_ids, sampling_params={"max_new_tokens": 0},
                                                return_logprob=True, logprob_start_len=logprob_start_len,
                                                image_data=per_row)

    def start_token_id(self) -> int:
        return first_special_id(self.tokenizer.bos_token_id, self.tokenizer.eos_token_id)

    async def cache_prefix(self, prompt: str, images: Sequence[Any] = ()) -> None:
        await self.engine.async_generate(prompt, {"max_new_tokens": 0}, image_data=_image_data(images))

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.model_path, "tokenizer_path": self.engine.tokenizer_path,
                **self.engine.get_stats()}


def _image_data(images: Sequence[Any]) -> list[Any] | None:
    """One prompt's images as the Engine takes them."""
    return list(images) if images else None
