"""The in-process backend: a furcate Engine, through its public async API only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ...lang.choices import ChoiceScores
from ..chat_template import ChatTemplate
from .base import Backend, choice_token_ids, logprob_values, start_token_id


class LocalBackend(Backend):
    """`LocalBackend(engine, chat_template=None)`; `chat_template` (a Jinja string) overrides the model's."""

    capabilities = frozenset({"regex", "json_schema", "ebnf", "stop_regex", "logprobs"})

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

    async def generate(self, prompt: str, sampling: dict[str, Any], **logprob_args: Any) -> dict | list[dict]:
        return await self.engine.async_generate(prompt, sampling, **logprob_args)

    async def generate_stream(self, prompt: str, sampling: dict[str, Any], **logprob_args: Any) -> AsyncIterator[dict]:
        chunks = await self.engine.async_generate(prompt, sampling, stream=True, **logprob_args)
        async for chunk in chunks:
            yield chunk

    async def score_choices(self, prompt: str, choices: list[str], unconditional: bool) -> list[ChoiceScores]:
        ids, starts = choice_token_ids(self.tokenizer, prompt, choices)
        first = min(starts)
        if len(choices) > 1:
            # Computed once here, the prompt is a cache hit for every choice below; sent with them instead, each
            # choice would compute whatever part of it was not cached yet (the scheduler only holds back
            # requests that share 32 or more uncached tokens).
            await self.cache_prefix(prompt)
        # One request of all choices: they batch together over the cached prompt.
        conditional = await self.engine.async_generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=first)
        scores = [logprob_values(r["meta_info"]["input_token_logprobs"], start - first)
                  for r, start in zip(conditional, starts)]
        if not unconditional:
            return [ChoiceScores(s) for s in scores]
        bare = [[start_token_id(self.tokenizer)] + row[start:] for row, start in zip(ids, starts)]
        alone = await self.engine.async_generate(
            input_ids=bare, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=1)
        return [ChoiceScores(s, logprob_values(r["meta_info"]["input_token_logprobs"], 0))
                for s, r in zip(scores, alone)]

    async def cache_prefix(self, prompt: str) -> None:
        await self.engine.async_generate(prompt, {"max_new_tokens": 0})

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.model_path, "tokenizer_path": self.engine.tokenizer_path,
                **self.engine.get_stats()}
