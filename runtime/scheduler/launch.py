"""Running scheduled batches, and all the state that lets the next batch be scheduled before a batch's tokens exist.

Both event loops call Scheduler.step(); they differ only in their launcher:
  InlineLauncher  (plain loop) runs a batch on the scheduler thread as soon as its sampling inputs are given,
                  and the loop completes it in the same round;
  WorkerLauncher  (overlap loop) runs batch N on a worker thread while the scheduler thread completes batch N-1,
                  schedules N+1 and fills N's grammar masks; sampling N waits only for those masks.

Future tokens: batch N+1 is scheduled before batch N's tokens are known, so a decode input whose token is still
being sampled is a placeholder naming a slot of the future buffer, which the runner resolves when N+1 starts
(batches run in order, so N has written it by then). A request's slot lives in `Req.future_slot` while its token
is in flight; `Req.discard_next` marks a token sampled from a state jump-forward has since changed; requests that
finish in N still take a step in N+1, whose token is dropped. FutureTokens is the only code that touches these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # batch.py itself asks FutureTokens for placeholders
    from .batch import ScheduleBatch
    from .req import Req

FUTURE_SLOTS = 1 << 16


class FutureTokens:
    """The buffer sampled tokens are written to, for a batch scheduled before they were known to read."""

    def __init__(self, device: str = "cpu") -> None:
        self.buffer = torch.zeros(FUTURE_SLOTS, dtype=torch.long, device=device)
        self.next_slot = 0

    def reserve(self, batch: ScheduleBatch) -> None:
        """Give every sampling slice of a launched batch the slot its token will be written to."""
        for piece in batch.slices:
            if piece.samples:
                piece.req.future_slot = self.next_slot
                batch.future_slots.append(self.next_slot)
                self.next_slot = (self.next_slot + 1) % FUTURE_SLOTS

    @staticmethod
    def placeholder(req: Req) -> int:
        """The input id standing for a request's token still being sampled (negative: never a real id)."""
        return -(req.future_slot + 1)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input ids with placeholders replaced by the tokens earlier batches wrote. Without asking which ids are
        placeholders (on a GPU that would wait for the device): real ids read slot 0 and keep their own value."""
        return torch.where(input_ids < 0, self.buffer[(-input_ids - 1).clamp(min=0)], input_ids)

    def publish(self, batch: ScheduleBatch, next_ids: torch.Tensor) -> None:
        if batch.future_slots:
            self.buffer[torch.tensor(batch.future_slots, device=self.buffer.device)] = next_ids

    @staticmethod
    def settle(req: Req, slots: Iterator[int]) -> bool:
        """A sampling slice's result reached the scheduler: the request's token is no longer in flight (unless
        a later batch already holds a newer slot). Advances `slots` (the batch's slots, in slice order) past this
        slice. False when the token must be dropped (sampled from a state jump-forward has since changed)."""
        if req.future_slot is not None and req.future_slot == next(slots, None):
            req.future_slot = None
        elif req.future_slot is None:
            next(slots, None)
        if req.discard_next:
            req.discard_next = False
            return False
        return True

    @staticmethod
    def redirect(req: Req) -> None:
        """Jump-forward changed a request whose next batch is already launched: drop that batch's token."""
        req.discard_next, req.future_slot = True, None


@dataclass
class Launched:
    batch: ScheduleBatch
    sampling_inputs: Future  # set by the scheduler thread once masks are filled
    result: Future  # StepResult


def abandon(launched: Launched) -> None:
    """Release a launched batch that will not be completed (the loop is stopping on an error)."""
    if not launched.sampling_inputs.done():  # never leave a runner waiting on us
        launched.sampling_inputs.set_exception(RuntimeError("scheduler loop stopped"))
    launched.result.exception()  # let a worker finish before the process goes away


class InlineLauncher:
    """The plain loop's launcher: the batch runs on the scheduler thread when its sampling inputs are set."""

    def __init__(self, run: Callable) -> None:
        self.run = run  # (batch, Future of its sampling inputs) -> StepResult

    def launch(self, batch: ScheduleBatch) -> Launched:
        inputs, result = Future(), Future()

        def run_now(done: Future) -> None:
            try:
                result.set_result(self.run(batch, done))
            except BaseException as error:  # noqa: BLE001 - handed to whoever completes the batch
                result.set_exception(error)

        inputs.add_done_callback(run_now)
        return Launched(batch, inputs, result)

    def close(self) -> None:
        pass


class WorkerLauncher:
    """The overlap loop's launcher: batches run in launch order on one worker thread."""

    def __init__(self, run: Callable) -> None:
        self.run = run
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furcate-forward")

    def launch(self, batch: ScheduleBatch) -> Launched:
        inputs: Future = Future()
        return Launched(batch, inputs, self.worker.submit(self.run, batch, inputs))

    def close(self) -> None:
        self.worker.shutdown(wait=True)
