"""The grammar backend protocol: compile a spec once, then one matcher per request drives its token mask.

Masks use one packed layout for every backend: int32 words, bit j of word i set when token 32*i + j is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch

KINDS = ("json_schema", "regex", "ebnf", "choices")
# SGLang's spelling of "any JSON value" (OpenAI's response_format json_object).
ANY_JSON = "$$ANY$$"


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to. `spec` is a string so specs hash, pickle and key the compile cache."""

    kind: str
    spec: str

    @classmethod
    def from_params(cls, json_schema: Any = None, regex: str | None = None, ebnf: str | None = None,
                    choices: list[str] | None = None) -> "GrammarSpec | None":
        given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf),
                                   ("choices", choices)) if v is not None}
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex, ebnf, choices; got {sorted(given)}")
        kind, value = next(iter(given.items()))
        return cls(kind, normalize(kind, value))


def normalize(kind: str, value: Any) -> str:
    if kind == "json_schema":
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
            value = value.model_json_schema()
        if isinstance(value, dict):
            return json.dumps(value)
        if not isinstance(value, str):
            raise ValueError(f"json_schema must be a dict, a JSON string or a pydantic model, got {type(value)}")
        if value != ANY_JSON:
            try:
                json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"json_schema is not valid JSON: {error}") from None
        return value
    if kind == "choices":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        return json.dumps(list(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string")
    return value


class Matcher(Protocol):
    """Per-request grammar state."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a packed bitmask."""

    def accept(self, token: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (the state is then unchanged)."""

    def is_terminated(self) -> bool:
        """The grammar has accepted its end (the stop token): nothing may follow."""

    def rollback(self, num_tokens: int) -> None: ...

    def jump_forward(self) -> str:
        """The continuation the grammar forces from here ('' when more than one is possible)."""


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises ValueError naming the problem when the spec does not compile."""


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits of tokens whose bit is clear become -inf. logits [B, V], bitmask [B, ceil(V/32)]."""
    vocab = logits.shape[-1]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
