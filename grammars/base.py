"""The grammar backend protocol: compile a spec once, then one matcher per request drives its token mask.

Masks use one packed layout for every backend: int32 words, bit j of word i set when token 32*i + j is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .spec import ANY_JSON, KINDS, GrammarSpec, normalize

__all__ = ["ANY_JSON", "KINDS", "Compiled", "CompiledGrammar", "Fidelity", "GrammarBackend", "GrammarPlan",
           "GrammarSpec", "Matcher", "PlanningBackend", "allocate_bitmask", "apply_bitmask", "normalize"]


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


@dataclass(frozen=True)
class Fidelity:
    """How faithfully a compiled grammar enforces its spec, as its backend reported or we measured at compile time.

    Exact means: the grammar accepts some serialization of every instance the spec allows, and none of any instance it
    forbids. Serialization choices are not departures: the JSON backends fix the key order to the schema's and the
    whitespace to `, ` and `: `, and none of them stops a key allowed by additionalProperties from repeating.
    """

    backend: str
    # Each entry names a keyword or feature and what the grammar does instead ("uniqueItems: not enforced").
    approximations: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.approximations

    def describe(self) -> str:
        return f"{self.backend}: " + ("exact" if self.exact else "; ".join(self.approximations))


class CompiledGrammar(Protocol):
    fidelity: Fidelity

    def matcher(self) -> Matcher: ...


class GrammarPlan(Protocol):
    """A spec a backend has converted but not yet compiled: how faithful its grammar will be is known already."""

    fidelity: Fidelity

    def compile(self) -> CompiledGrammar:
        """Raises ValueError naming the problem when the grammar does not compile."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises ValueError naming the problem when the spec does not compile."""


class PlanningBackend(GrammarBackend, Protocol):
    """A backend that can tell a grammar's fidelity before the costly part of its compile (xgrammar's can take
    seconds), so grammar_backend="auto" compiles only the grammar it will use."""

    def plan(self, spec: GrammarSpec) -> GrammarPlan:
        """Raises ValueError naming the problem when the spec does not convert."""


@dataclass(frozen=True)
class Compiled:
    """The plan of a backend whose conversion is its whole compile: the grammar is there already."""

    grammar: CompiledGrammar

    @property
    def fidelity(self) -> Fidelity:
        return self.grammar.fidelity

    def compile(self) -> CompiledGrammar:
        return self.grammar


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """In host memory, where matchers fill it (pinned when there is a GPU, so copying it there does not wait)."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32, device="cpu",
                      pin_memory=torch.cuda.is_available())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits of tokens whose bit is clear become -inf. logits [B, V], bitmask [B, ceil(V/32)]."""
    vocab = logits.shape[-1]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
