"""Where a scheduled batch runs; the one thing the two event loops do differently.

Both loops call Scheduler.step(), which hands each new batch to its launcher:
  PlainLauncher    runs the batch to completion on the scheduler thread and folds its results in at once;
  OverlapLauncher  runs batch N on a worker thread while the scheduler thread folds in batch N-1, schedules N+1
                   and fills N's grammar masks; sampling N waits only for those masks. Batch N+1 is scheduled
                   before N's tokens are known, so it owns the token table those tokens pass through
                   (future_tokens.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..executor.batch import ScheduleBatch
from ..executor.model_runner import ModelRunner, SamplingInputs, StepResult
from .future_tokens import FutureTokens
from .req import Req

Fold = Callable[[ScheduleBatch, StepResult], None]  # the scheduler's process_result
InputsOf = Callable[[ScheduleBatch], SamplingInputs]  # the scheduler's sampling_inputs


class PlainLauncher:
    """Each batch runs to completion when it is submitted, on the scheduler thread."""

    busy = False  # nothing is ever in flight between rounds

    def __init__(self, runner: ModelRunner, fold: Fold, inputs_of: InputsOf) -> None:
        self.runner, self.fold, self.inputs_of = runner, fold, inputs_of

    def submit(self, batch: ScheduleBatch | None) -> None:
        if batch is None:
            return
        self.runner.prepare(batch)
        with self.runner.on_forward_stream():
            result = self.runner.run_batch(batch, lambda: self.inputs_of(batch))
        self.fold(batch, result)

    def unseen(self, req: Req) -> int:
        return 0

    def redirect(self, req: Req) -> None:
        """Nothing to redirect: no batch is running while the scheduler changes a request."""

    def drain(self) -> None:
        """Nothing to drain: every batch was folded in when it was submitted."""

    def close(self) -> None:
        """Nothing to stop."""


class VerifyingLauncher(PlainLauncher):
    """The plain loop's launcher under speculative decoding: a batch with drafts runs `verify` (the speculator's
    verify step, scheduler/plugins/speculation.py) instead of plain sampling."""

    def __init__(self, verify: Callable[[ScheduleBatch], StepResult], *args: Any) -> None:
        super().__init__(*args)
        self.verify = verify

    def submit(self, batch: ScheduleBatch | None) -> None:
        if batch is None or not any(piece.draft for piece in batch.slices):
            super().submit(batch)
            return
        self.runner.prepare(batch)
        with self.runner.on_forward_stream():
            result = self.verify(batch)
        self.fold(batch, result)


@dataclass
class Launched:
    batch: ScheduleBatch
    slots: torch.Tensor  # where its sampled tokens go in the token table
    sampling_inputs: Future  # set by the scheduler thread once the previous batch is folded in and masks filled
    result: Future  # StepResult


class OverlapLauncher:
    """Batches run in launch order on one worker thread; at most one is in flight between rounds."""

    def __init__(self, runner: ModelRunner, fold: Fold, inputs_of: InputsOf) -> None:
        self.runner, self.fold, self.inputs_of = runner, fold, inputs_of
        self.tokens = FutureTokens(runner.req_pool.size, runner.device)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furcate-forward")
        self.in_flight: Launched | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def submit(self, batch: ScheduleBatch | None) -> None:
        """Launch the new batch, fold in the one before it, then give the new one its sampling inputs (its grammar
        masks need the previous batch's tokens accepted first)."""
        launched = self._launch(batch) if batch is not None else None
        previous, self.in_flight = self.in_flight, launched
        try:
            if previous is not None:
                self._complete(previous)
        except BaseException:
            if launched is not None:  # or its worker waits for sampling inputs forever
                abandon(launched)
                self.in_flight = None
            raise
        if launched is not None:
            launched.sampling_inputs.set_result(self.inputs_of(batch))

    def unseen(self, req: Req) -> int:
        return self.tokens.unseen(req)

    def redirect(self, req: Req) -> None:
        self.tokens.redirect(req)

    def drain(self) -> None:
        """Fold in the batch in flight now (retraction must see every sampled token first)."""
        previous, self.in_flight = self.in_flight, None
        if previous is not None:
            self._complete(previous)

    def close(self) -> None:
        if self.in_flight is not None:
            abandon(self.in_flight)
            self.in_flight = None
        self.worker.shutdown(wait=True)

    def _launch(self, batch: ScheduleBatch) -> Launched:
        self.runner.prepare(batch)
        slots = self.tokens.reserve(batch)
        inputs: Future = Future()
        return Launched(batch, slots, inputs, self.worker.submit(self._run, batch, slots, inputs))

    def _run(self, batch: ScheduleBatch, slots: torch.Tensor, inputs: Future) -> StepResult:
        """On the worker: the forward reads the tokens earlier batches wrote, and writes its own for the next."""
        with self.runner.on_forward_stream():
            batch.forward.input_ids = self.tokens.resolve(batch.forward.input_ids)
            result = self.runner.run_batch(batch, inputs.result)
            self.tokens.publish(slots, result.sampled)
        return result

    def _complete(self, launched: Launched) -> None:
        result = launched.result.result()
        self.tokens.settle(launched.batch, result)
        self.fold(launched.batch, result)


def abandon(launched: Launched) -> None:
    """Release a launched batch that will not be completed (the loop is stopping on an error)."""
    if not launched.sampling_inputs.done():  # never leave a runner waiting on us
        launched.sampling_inputs.set_exception(RuntimeError("scheduler loop stopped"))
    launched.result.exception()  # let a worker finish before the process goes away
