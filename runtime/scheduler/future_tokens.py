"""The overlap loop's token table: tokens a launched batch is still sampling, for the batch scheduled after it.

The overlap loop schedules batch N+1 before batch N's tokens reach the scheduler, so a decode input whose token
is still being sampled is a placeholder naming its request's slot here. Batch N writes its sampled tokens into
the table by request slot, on the device, and N+1 reads them there when it starts (batches run in launch order).
The scheduler never waits for them: it learns each token when it folds in N's results.

The table also knows, per request, how many of its tokens are in flight (the scheduler lays out one placeholder
for it) and which in-flight tokens were sampled from a state that jump-forward changed since (they are dropped).
Only the overlap launcher (launchers.py) holds one; the plain loop never has a token in flight.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from ..executor.batch import ScheduleBatch

if TYPE_CHECKING:
    from ..executor.model_runner import StepResult
    from .req import Req


class FutureTokens:
    def __init__(self, slots: int, device: str) -> None:
        self.table = torch.zeros(slots, dtype=torch.long, device=device)  # by request slot (req_pool_idx)
        self.in_flight: Counter[int] = Counter()  # id(req) -> launched batches sampling for it, not yet folded in
        self.stale: set[int] = set()  # id(req) whose in-flight token is to be dropped

    def unseen(self, req: Req) -> int:
        """Tokens of this request sampled by launched batches whose results the scheduler has not seen."""
        return self.in_flight[id(req)]

    def reserve(self, batch: ScheduleBatch) -> torch.Tensor:
        """A batch is launched: each request it samples for has one more token in flight. Returns the table slots
        its tokens go to, taken now: a request that finishes meanwhile gives its slot back before they are written."""
        reqs = sampling_reqs(batch)
        self.in_flight.update(id(req) for req in reqs)
        return torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.long, device=self.table.device)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input ids with placeholders replaced by the tokens earlier batches wrote. Without asking which ids are
        placeholders (on a GPU that would wait for the device): real ids read slot 0 and keep their own value."""
        return torch.where(input_ids < 0, self.table[(-input_ids - 1).clamp(min=0)], input_ids)

    def publish(self, slots: torch.Tensor, sampled: torch.Tensor | None) -> None:
        """Write a batch's sampled tokens (on the device, in sampling-slice order) where the next batch reads."""
        if sampled is not None:
            self.table[slots] = sampled

    def settle(self, batch: ScheduleBatch, result: StepResult) -> None:
        """A batch's results reached the scheduler: its tokens are no longer in flight; those sampled from a
        state that has changed since are taken out of the result."""
        for index, piece in enumerate(batch.slices):
            key = id(piece.req)
            if not piece.samples:
                continue
            if key in self.stale:
                self.stale.discard(key)
                result.drop(index)
            else:
                self._land(key)

    def redirect(self, req: Req) -> None:
        """Jump-forward changed a request on the host: the token a launched batch samples for it is stale (its
        K/V input was right, but what it predicts is not the next token any more)."""
        key = id(req)
        if self.in_flight[key] > 0:
            self._land(key)
            self.stale.add(key)

    def _land(self, key: int) -> None:
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]


def sampling_reqs(batch: ScheduleBatch) -> list[Req]:
    return [piece.req for piece in batch.slices if piece.samples]
