"""Turn a batch of logits into next tokens: logit bias, penalties, min-token masking, then greedy or sampled.

Random sampling draws its noise from a generator seeded by (request seed, output position), so a request with a
given seed yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...grammars.base import apply_bitmask
from .params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    seed: int
    stop_ids: frozenset[int]  # ids that would end the request, masked while min_new_tokens is unmet


def sample(logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None = None,
           constrained: list[int] | None = None) -> torch.Tensor:
    """logits: [B, V] float32 raw model logits (left untouched). Rows listed in `constrained` may only pick
    tokens their bitmask row allows. Returns next token ids [B]."""
    raw = logits
    logits = adjust_logits(logits, rows)
    if constrained:
        if logits is raw:
            logits = logits.clone()
        index = torch.tensor(constrained)
        masked = logits[index]
        apply_bitmask(masked, bitmask[index])
        logits[index] = masked
    greedy = torch.tensor([row.params.is_greedy for row in rows])
    next_ids = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        random_rows = (~greedy).nonzero().flatten().tolist()
        picked = [sample_row(logits[i], rows[i]) for i in random_rows]
        next_ids[random_rows] = torch.tensor(picked, dtype=next_ids.dtype)
    return next_ids


def adjust_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply per-request logit bias, penalties and min_new_tokens masking; copies only when needed."""
    needs = [
        i
        for i, row in enumerate(rows)
        if row.params.logit_bias or row.params.has_penalties or len(row.output_ids) < row.params.min_new_tokens
    ]
    if not needs:
        return logits
    logits = logits.clone()
    for i in needs:
        row, params = rows[i], rows[i].params
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
        if params.has_penalties:
            apply_penalties(logits[i], row)
        if len(row.output_ids) < params.min_new_tokens and row.stop_ids:
            logits[i, list(row.stop_ids)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row. Repetition penalty (HF/vLLM style) sees prompt and output; the OpenAI-style
    frequency and presence penalties see the output only."""
    params = row.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    if row.output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(row.output_ids), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    params = row.params
    probs = torch.softmax(logits / params.temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        # Keep the smallest head whose mass reaches top_p (the token that crosses it stays).
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    keep[0] = True
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    generator = torch.Generator().manual_seed(_step_seed(row.seed, len(row.output_ids)))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i / sum(p).
    noise = torch.empty_like(kept).exponential_(generator=generator)
    return int(sorted_ids[(kept / noise).argmax()])


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 12_345) % (2**63 - 1)
