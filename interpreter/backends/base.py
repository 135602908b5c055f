"""The protocol between the interpreter and whatever serves the model.

Only plain data crosses it: a prompt string and a sampling dict in the runtime's field names going in,
Engine-shaped result dicts (`text`, `output_ids`, `meta_info`) coming back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from ...lang.choices import ChoiceScores
from ..chat_template import ChatTemplate


class Backend(ABC):
    """What a program runs against. Every method that talks to the model is async."""

    # Optional features a backend serves: "regex", "json_schema", "ebnf", "stop_regex", "logprobs", "images".
    capabilities: frozenset[str] = frozenset()

    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """The role markers of the model's chat template."""

    @abstractmethod
    async def generate(self, prompt: str, sampling: dict[str, Any], **logprob_args: Any) -> dict | list[dict]:
        """One completion of `prompt` (a list of `n` when sampling["n"] > 1)."""

    @abstractmethod
    def generate_stream(self, prompt: str, sampling: dict[str, Any], **logprob_args: Any) -> AsyncIterator[dict]:
        """Chunks of one completion; `text` is cumulative."""

    @abstractmethod
    async def score_choices(self, prompt: str, choices: list[str], unconditional: bool) -> list[ChoiceScores]:
        """The logprobs of each choice's tokens after `prompt` (all choices scored in one batched request)."""

    @abstractmethod
    async def cache_prefix(self, prompt: str) -> None:
        """Compute `prompt` once so later requests starting with it find it in the prefix cache."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}


def choice_token_ids(tokenizer: Any, prompt: str, choices: list[str]) -> tuple[list[list[int]], list[int]]:
    """Token ids of prompt+choice for each choice, and where each choice's own tokens start.

    A choice starts at the first token where prompt+choice and the prompt alone tokenize differently, so a
    token that merges the prompt's end with the choice's start counts as the choice's (token healing).
    """
    prompt_ids = tokenizer.encode(prompt)
    full = [tokenizer.encode(prompt + choice) for choice in choices]
    starts = []
    for ids in full:
        common = 0
        for a, b in zip(prompt_ids, ids):
            if a != b:
                break
            common += 1
        starts.append(min(common, len(ids) - 1))
    return full, starts


def start_token_id(tokenizer: Any) -> int:
    """The context of an unconditional score: the tokenizer's BOS token, or its EOS when it has none."""
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    raise ValueError("the tokenizer has neither a BOS nor an EOS token to score choices unconditionally")


def logprob_values(entries: list, skip: int) -> list[float]:
    """The logprobs of [logprob, token_id, text] entries after the first `skip`, without the null first one."""
    return [entry[0] for entry in entries[skip:] if entry[0] is not None]
