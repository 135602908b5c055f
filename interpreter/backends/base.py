"""The protocol between the interpreter and whatever serves the model.

Only plain data crosses it: a prompt string and a sampling dict in the runtime's field names going in (a gen's
constraint as the GrammarSpec it built, under "grammar"), Engine-shaped result dicts (`text`, `output_ids`,
`meta_info`) coming back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ...lang.choices import ChoiceScores
from ..chat_template import ChatTemplate


class Backend(ABC):
    """What a program runs against. Every method that talks to the model is async."""

    @property
    def image_placeholder(self) -> str | None:
        """The text that shows an image in a prompt (a vision-language model's `<image>`); None: no images.
        The images of a prompt go with it, in the order of their placeholders (`images=`)."""
        return None

    @property
    def image_tokens(self) -> int | None:
        """Prompt tokens each placeholder becomes; None: each image its own (Qwen2-VL)."""
        return 0

    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """The role markers of the model's chat template."""

    @abstractmethod
    async def generate(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                       **logprob_args: Any) -> dict | list[dict]:
        """One completion of `prompt` (a list of `n` when sampling["n"] > 1)."""

    @abstractmethod
    def generate_stream(self, prompt: str, sampling: dict[str, Any], images: Sequence[Any] = (),
                        **logprob_args: Any) -> AsyncIterator[dict]:
        """Chunks of one completion; `text` is cumulative."""

    @abstractmethod
    async def score_choices(self, prompt: str, choices: list[str], unconditional: bool,
                            images: Sequence[Any] = ()) -> list[ChoiceScores]:
        """The logprobs of each choice's tokens after `prompt` (all choices scored in one batched request)."""

    @abstractmethod
    async def cache_prefix(self, prompt: str, images: Sequence[Any] = ()) -> None:
        """Compute `prompt` once so later requests starting with it find it in the prefix cache."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}


class TokenScoringBackend(Backend):
    """A backend over furcate's runtime (in process or over HTTP): it scores choices the runtime's way, from the
    prompt logprobs of token ids, with all choices in one request over the cached prompt."""

    @abstractmethod
    async def encode(self, texts: list[str]) -> list[list[int]]:
        """`tokenizer.encode(text)` for each text, as the model's tokenizer does it (its special tokens included)."""

    @abstractmethod
    async def prefill_logprobs(self, input_ids: list[list[int]], logprob_start_len: int,
                               images: Sequence[Any] = ()) -> list[dict]:
        """One request of every row with max_new_tokens 0 and return_logprob: each row's result dict."""

    @abstractmethod
    def start_token_id(self) -> int:
        """The context of an unconditional score: the BOS token, or the EOS when the tokenizer has none."""

    async def score_choices(self, prompt: str, choices: list[str], unconditional: bool,
                            images: Sequence[Any] = ()) -> list[ChoiceScores]:
        prompt_ids, *ids = await self.encode([prompt] + [prompt + choice for choice in choices])
        starts = choice_starts(prompt_ids, ids)
        first = min(starts)
        # The prompt's images (all before the choices) each grow from one placeholder to image_tokens tokens.
        if images and self.image_tokens is None:
            raise ValueError("select after an image needs a model whose images all take the same number of tokens")
        shift = len(images) * (self.image_tokens - 1) if images else 0
        if len(choices) > 1:
            # Computed once here, the prompt is a cache hit for every choice below; sent with them instead, each
            # choice would compute whatever part of it was not cached yet (the scheduler only holds back
            # requests that share 32 or more uncached tokens).
            await self.cache_prefix(prompt, images)
        # One request of all choices: they batch together over the cached prompt.
        conditional = await self.prefill_logprobs(ids, first + shift, images)
        scores = [logprob_values(r["meta_info"]["input_token_logprobs"], start - first)
                  for r, start in zip(conditional, starts)]
        if not unconditional:
            return [ChoiceScores(s) for s in scores]
        bare = [[self.start_token_id()] + row[start:] for row, start in zip(ids, starts)]
        alone = await self.prefill_logprobs(bare, 1)
        return [ChoiceScores(s, logprob_values(r["meta_info"]["input_token_logprobs"], 0))
                for s, r in zip(scores, alone)]


def choice_starts(prompt_ids: Sequence[object], choice_ids: Sequence[Sequence[object]]) -> list[int]:
    """Where each choice's own tokens start in the tokens of prompt+choice (token ids, or token texts where an
    API gives only those).

    A choice starts at the first token where prompt+choice and the prompt alone tokenize differently, so a
    token that merges the prompt's end with the choice's start counts as the choice's (token healing).
    """
    starts = []
    for ids in choice_ids:
        common = 0
        for a, b in zip(prompt_ids, ids):
            if a != b:
                break
            common += 1
        starts.append(min(common, len(ids) - 1))
    return starts


def first_special_id(bos_token_id: int | None, eos_token_id: int | None) -> int:
    """The BOS token id, or the EOS one when there is no BOS (the start of an unconditional score)."""
    for token_id in (bos_token_id, eos_token_id):
        if token_id is not None:
            return token_id
    raise ValueError("the tokenizer has neither a BOS nor an EOS token to score choices unconditionally")


def logprob_values(entries: list, skip: int) -> list[float]:
    """The logprobs of [logprob, token_id, text] entries after the first `skip`, without the null first one."""
    return [entry[0] for entry in entries[skip:] if entry[0] is not None]


def wire_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling dict as it goes over HTTP: a built grammar becomes its field (json_schema, regex or ebnf)."""
    grammar = sampling.get("grammar")
    if grammar is None:
        return sampling
    flat = {key: value for key, value in sampling.items() if key != "grammar"}
    flat[grammar.kind] = grammar.spec
    return flat
