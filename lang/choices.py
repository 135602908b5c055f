"""The three ways `select` turns per-token logprobs of each choice into a decision (SGLang's names).

Each method receives, per choice, the logprobs of the choice's own tokens given the text before it, and for
`unconditional_likelihood_normalized` also given no context (only the start token).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ChoiceScores:
    """Logprobs of one choice's tokens, in order."""

    token_logprobs: list[float]
    unconditional_logprobs: list[float] | None = None


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesMethod(Protocol):
    requires_unconditional: bool

    def __call__(self, choices: list[str], scores: list[ChoiceScores], temperature: float = 0.0,
                 rng: random.Random | None = None) -> ChoicesDecision: ...


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def pick(scores: list[float], temperature: float, rng: random.Random | None) -> int:
    """Argmax at temperature 0 (first on ties); otherwise sample from softmax(scores / temperature)."""
    if temperature <= 0:
        return max(range(len(scores)), key=lambda i: (scores[i], -i))
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return (rng or random).choices(range(len(scores)), weights=weights)[0]


class TokenLengthNormalized:
    """The choice whose tokens have the highest mean logprob."""

    requires_unconditional = False

    def __call__(self, choices, scores, temperature=0.0, rng=None) -> ChoicesDecision:
        normalized = [mean(s.token_logprobs) for s in scores]
        index = pick(normalized, temperature, rng)
        return ChoicesDecision(choices[index], {
            "normalized_prompt_logprobs": normalized,
            "choice_token_logprobs": [s.token_logprobs for s in scores],
        })

    def __repr__(self) -> str:
        return "token_length_normalized"


class GreedyTokenSelection:
    """Compare choices token by token, keeping those with the best logprob at each position; a choice that ran
    out of tokens is padded with its own mean logprob. Ties left at the end go to the first choice."""

    requires_unconditional = False

    def __call__(self, choices, scores, temperature=0.0, rng=None) -> ChoicesDecision:
        width = max(len(s.token_logprobs) for s in scores)
        rows = [s.token_logprobs + [mean(s.token_logprobs)] * (width - len(s.token_logprobs)) for s in scores]
        remaining = list(range(len(choices)))
        for column in range(width):
            best = max(rows[i][column] for i in remaining)
            remaining = [i for i in remaining if rows[i][column] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "choice_token_logprobs": [s.token_logprobs for s in scores],
            "padded_token_logprobs": rows,
        })

    def __repr__(self) -> str:
        return "greedy_token_selection"


class UnconditionalLikelihoodNormalized:
    """The choice whose tokens gain the most, on average, from the context: mean(conditional - unconditional)."""

    requires_unconditional = True

    def __call__(self, choices, scores, temperature=0.0, rng=None) -> ChoicesDecision:
        if any(s.unconditional_logprobs is None for s in scores):
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs for every choice")
        gains = [mean([c - u for c, u in zip(s.token_logprobs, s.unconditional_logprobs)]) for s in scores]
        index = pick(gains, temperature, rng)
        return ChoicesDecision(choices[index], {
            "normalized_prompt_logprobs": [mean(s.token_logprobs) for s in scores],
            "normalized_unconditional_prompt_logprobs": [mean(s.unconditional_logprobs) for s in scores],
            "unconditional_gains": gains,
            "choice_token_logprobs": [s.token_logprobs for s in scores],
            "unconditional_token_logprobs": [s.unconditional_logprobs for s in scores],
        })

    def __repr__(self) -> str:
        return "unconditional_likelihood_normalized"


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
