"""Verifying drafts: which of a request's drafted tokens the model accepts, and the one token that follows them.

A verify forward gives logits at the request's last token and at each draft. Row j is processed exactly as plain
decoding would process it had drafts 0..j-1 been sampled (logit bias, penalties, min_new_tokens, grammar mask:
the caller builds row j's SamplingRow and mask that way), so each emitted token comes from the distribution plain
decoding draws it from:
- greedy: draft j is accepted while it equals row j's argmax; the first mismatching row's argmax, or after the last
  draft the next row's argmax, ends the step. These are the tokens plain greedy decoding emits.
- sampled: a draft is a point mass q = δ(d). Accepting d with probability p(d), else drawing from p with d removed
  and renormalised, gives P(d) = p(d) and P(x) = (1 - p(d)) p(x) / (1 - p(d)) = p(x) for x != d: exactly p.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from ..sampling.sampler import SamplingRow, adjust_logits, mask_rows, sample_random, sampling_probs


@dataclass
class Proposal:
    """One request's part of a verify forward: its drafts, and one sampling row per logits row (1 + drafts)."""

    draft: list[int]
    rows: list[SamplingRow]

    @classmethod
    def of(cls, row: SamplingRow, draft: list[int]) -> Proposal:
        """Row j sees drafts 0..j-1 as output already (penalties, min_new_tokens and the seed's step follow)."""
        return cls(draft, [dataclasses.replace(row, output_ids=row.output_ids + draft[:j])
                           for j in range(len(draft) + 1)])


def verify(logits: torch.Tensor, proposals: list[Proposal], bitmask: torch.Tensor | None = None,
           constrained: list[int] | None = None) -> list[list[int]]:
    """logits: [sum of len(p.rows), V] raw, proposal after proposal; bitmask rows (listed in `constrained`) index
    the same rows. Returns per proposal the tokens it emits: its accepted drafts, then one more."""
    rows = [row for p in proposals for row in p.rows]
    processed = adjust_logits(logits, rows)
    if constrained:
        processed = processed.clone() if processed is logits else processed
        mask_rows(processed, bitmask, constrained)
    targets = Targets(processed, rows, proposals)
    emitted, draws, offset = [], [], 0
    for p in proposals:
        tokens, draw_at = targets.accept(p, offset)
        emitted.append(tokens)
        if draw_at is not None:
            draws.append((tokens, draw_at))
        offset += len(p.rows)
    if draws:
        # The plain sampler, on the rows where a step draws as a plain step would: a request with no draft (or all
        # accepted) draws its token with the same seeded number as without speculation, whatever shares its batch.
        at = [i for _, i in draws]
        for (tokens, _), token in zip(draws, sample_random(processed[at], [rows[i] for i in at]).tolist()):
            tokens.append(token)
    return emitted


class Targets:
    """The processed rows of one verify forward: argmax for greedy rows, distributions for sampled ones."""

    def __init__(self, processed: torch.Tensor, rows: list[SamplingRow], proposals: list[Proposal]) -> None:
        self.rows = rows
        self.argmax = processed.argmax(dim=-1).tolist()
        drafted = [offset + j for offset, p in zip(offsets(proposals), proposals) for j in range(len(p.draft))
                   if not rows[offset + j].params.is_greedy]
        self.probs_row = {i: n for n, i in enumerate(drafted)}
        self.probs = sampling_probs(processed[drafted], [rows[i] for i in drafted]) if drafted else None
        self.draft_probs = self._draft_probs(proposals, drafted)

    def _draft_probs(self, proposals: list[Proposal], drafted: list[int]) -> dict[int, float]:
        """p(draft) at every sampled row that has a draft, read from the device at once."""
        if not drafted:
            return {}
        tokens = {offset + j: token for offset, p in zip(offsets(proposals), proposals)
                  for j, token in enumerate(p.draft)}
        index = torch.arange(len(drafted), device=self.probs.device)
        chosen = self.probs[index, torch.tensor([tokens[i] for i in drafted], device=self.probs.device)]
        return dict(zip(drafted, chosen.tolist()))

    def accept(self, p: Proposal, offset: int) -> tuple[list[int], int | None]:
        """The proposal's tokens, and the row whose token the plain sampler still has to draw (None: complete)."""
        for j, token in enumerate(p.draft):
            i = offset + j
            if self.rows[i].params.is_greedy:
                if self.argmax[i] != token:
                    return p.draft[:j] + [self.argmax[i]], None
            elif uniform(self.rows[i], "accept") >= self.draft_probs[i]:
                return p.draft[:j] + [self.residual(i, token)], None
        last = offset + len(p.draft)
        if self.rows[last].params.is_greedy:
            return p.draft + [self.argmax[last]], None
        return list(p.draft), last

    def residual(self, i: int, rejected: int) -> int:
        """A token from row i's distribution with the rejected draft removed and the rest renormalised."""
        probs = self.probs[self.probs_row[i]].clone()
        probs[rejected] = 0.0
        return inverse_cdf(probs, uniform(self.rows[i], "residual"))


def offsets(proposals: list[Proposal]) -> list[int]:
    """Where each proposal's rows start."""
    starts, offset = [], 0
    for p in proposals:
        starts.append(offset)
        offset += len(p.rows)
    return starts


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The first token whose running sum of weights exceeds u * total; never a zero-weight one (rounding at the
    top end falls back to the last token with weight)."""
    cdf = weights.double().cumsum(0)
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1],
                                   right=True).clamp(max=len(weights) - 1))
    return token if float(weights[token]) > 0 else int(weights.nonzero().max())


def uniform(row: SamplingRow, purpose: str) -> float:
    """A uniform number in [0, 1) fixed by the row's seed, its output position and what it decides: a seeded
    request verifies the same way whatever shares its batch."""
    return random.Random(f"{row.seed}:{len(row.output_ids)}:{purpose}").random()
