"""The ways a forward runs, behind one face: the model runner asks its runners in order, and the first that takes a
batch runs it.

Three runners: CUDA graph replay of decode batches (cuda_graph_runner.py), compiled decode steps on a CPU
(compiled_decode.py), and the eager model with the attention backend's plan (EagerRunner, here), which takes every
batch and so comes last. A batch is taken on the scheduler thread (prepare, which plans it) and found again on the
forward thread (claims): the runners may have changed in between (with the overlap loop the next batch's
prepare can adopt compiled graphs while this one is in flight), so the forward thread asks what the batch was
planned for rather than which runner would take it now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..attention.base import AttentionBackend, ForwardBatch


class DecodeRunner(Protocol):
    """One way of running a forward: plan a batch on the scheduler thread, run it on the forward thread."""

    def prepare(self, forward: ForwardBatch) -> ForwardBatch | None:
        """On the scheduler thread, which edits the request table: the batch as this runner runs it, planned (and
        padded, for a CUDA graph), or None where the runner does not take it."""
        ...

    def claims(self, forward: ForwardBatch) -> bool:
        """On the forward thread: whether this runner's prepare planned the batch."""
        ...

    def run(self, forward: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Logits of the batch's `rows`, of a batch claims accepted."""
        ...


class EagerRunner:
    """Any batch through the model's modules one op at a time, after the attention backend planned it; the
    runner every other declines a batch to. snapshot: the tensor-parallel followers' copy of the request-table
    entries the batch reads (taken beside the plan, for the same reason)."""

    def __init__(self, model, backend: AttentionBackend, snapshot: Callable[[ForwardBatch], None]) -> None:
        self.model, self.backend, self.snapshot = model, backend, snapshot

    def prepare(self, forward: ForwardBatch) -> ForwardBatch:
        self.backend.init_forward_metadata(forward)
        self.snapshot(forward)
        return forward

    def claims(self, forward: ForwardBatch) -> bool:
        return True

    def run(self, forward: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        hidden = self.model(forward, self.backend)
        return self.model.compute_logits(hidden[rows])


def prepare_first(runners: Sequence[DecodeRunner], forward: ForwardBatch) -> ForwardBatch:
    """The batch as planned by the first runner that takes it (the eager runner, last, takes any)."""
    return next(prepared for runner in runners if (prepared := runner.prepare(forward)) is not None)


def claimant(runners: Sequence[DecodeRunner], forward: ForwardBatch) -> DecodeRunner:
    """The runner whose prepare planned the batch."""
    return next(runner for runner in runners if runner.claims(forward))
