"""The grammar backend protocol: compile a spec once, then one matcher per request drives its token mask.

Masks use one packed layout for every backend: int32 words, bit j of word i set when token 32*i + j is allowed.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .spec import ANY_JSON, KINDS, GrammarSpec, normalize

__all__ = ["ANY_JSON", "KINDS", "GrammarSpec", "normalize", "Matcher", "CompiledGrammar", "GrammarBackend",
           "allocate_bitmask", "apply_bitmask"]


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
