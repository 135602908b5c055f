"""The overlapped event loop: batch N's forward runs on a worker thread while this thread processes batch N-1's
results, schedules batch N+1 and fills batch N's grammar masks; sampling N waits only for those masks.

Batch N+1 is scheduled before batch N's tokens are known: a decode input whose token is still being sampled is
a placeholder naming a slot of the runner's future buffer, which the worker resolves when N+1 starts (the
worker runs batches in order, so N has written it by then). Requests that finish in N still take a step in
N+1; that token is dropped.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .batch import ScheduleBatch
from .model_runner import FUTURE_SLOTS, SamplingInputs, StepResult

if TYPE_CHECKING:
    from .scheduler import Scheduler


@dataclass
class Launched:
    batch: ScheduleBatch
    sampling_inputs: Future  # set by the scheduler thread once masks are filled
    result: Future  # StepResult, set by the worker


class OverlapLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furcate-forward")
        self.next_slot = 0

    def run(self) -> None:
        scheduler = self.scheduler
        in_flight: Launched | None = None
        launched: Launched | None = None
        try:
            while scheduler.receive_messages(block=in_flight is None and not scheduler.has_work):
                if in_flight is not None and scheduler.memory.room() < len(scheduler.running):
                    # Retraction must see every sampled token: finish the in-flight batch first.
                    self.complete(in_flight, None)
                    in_flight = None
                batch = scheduler.next_batch()
                launched = self.launch(batch) if batch is not None else None
                if in_flight is not None:
                    self.complete(in_flight, launched)
                if launched is not None:
                    launched.sampling_inputs.set_result(scheduler.sampling_inputs(launched.batch))
                scheduler.send_outputs()
                in_flight = launched
        finally:
            # An error while completing batch N leaves batch N+1 launched too: release both, or the worker waits
            # for N+1's masks forever and the error never reaches the engine.
            for pending in (in_flight, launched):
                if pending is not None:
                    self.abandon(pending)
            self.worker.shutdown(wait=True)

    @staticmethod
    def abandon(launched: Launched) -> None:
        if not launched.sampling_inputs.done():  # never leave the worker waiting on us
            launched.sampling_inputs.set_exception(RuntimeError("scheduler loop stopped"))
        launched.result.exception()  # let the worker finish before the process goes away

    def launch(self, batch: ScheduleBatch) -> Launched:
        for piece in batch.slices:
            if piece.samples:
                piece.req.future_slot = self.next_slot
                batch.future_slots.append(self.next_slot)
                self.next_slot = (self.next_slot + 1) % FUTURE_SLOTS
        self.runner.prepare(batch)
        inputs: Future = Future()
        return Launched(batch, inputs, self.worker.submit(self._forward_and_sample, batch, inputs))

    def _forward_and_sample(self, batch: ScheduleBatch, inputs: Future) -> StepResult:
        logits = self.runner.forward(batch)
        sampling: SamplingInputs = inputs.result()
        return self.runner.sample(batch, logits, sampling)

    def complete(self, launched: Launched, next_launched: Launched | None) -> None:
        result = launched.result.result()
        in_flight = {id(p.req) for p in next_launched.batch.slices} if next_launched is not None else set()
        self.scheduler.process_result(launched.batch, result, in_flight)
