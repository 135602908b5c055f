"""The launchers and the overlap loop's token table without a model (the engine tests run them with one)."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from furcate.runtime.executor.batch import ScheduleBatch, placeholder
from furcate.runtime.executor.model_runner import StepResult
from furcate.runtime.scheduler.future_tokens import FutureTokens
from furcate.runtime.scheduler.launchers import OverlapLauncher, PlainLauncher


def _batch(*samples: bool, first_slot: int = 0) -> ScheduleBatch:
    reqs = [SimpleNamespace(req_pool_idx=first_slot + i) for i in range(len(samples))]
    slices = [SimpleNamespace(req=r, samples=s) for r, s in zip(reqs, samples)]
    return ScheduleBatch(slices, forward=SimpleNamespace(input_ids=torch.tensor([1])), logit_ranges=[])


class Runner:
    """Stands in for ModelRunner: what the launchers call, on whichever thread calls it."""

    def __init__(self, run=None) -> None:
        self.req_pool, self.device = SimpleNamespace(size=8), "cpu"
        self.run = run or (lambda batch, inputs: StepResult(next_ids={0: inputs()}))
        self.threads: list[str] = []

    def prepare(self, batch) -> None:
        self.threads.append(threading.current_thread().name)

    def on_forward_stream(self):
        return contextlib.nullcontext()

    def run_batch(self, batch, inputs) -> StepResult:
        return self.run(batch, inputs)


def test_token_table_round_trip_by_request_slot():
    tokens = FutureTokens(8, "cpu")
    batch = _batch(True, False, True, first_slot=5)
    first, middle, third = (piece.req for piece in batch.slices)
    slots = tokens.reserve(batch)
    assert slots.tolist() == [5, 7] and tokens.unseen(first) == 1 and tokens.unseen(middle) == 0
    first.req_pool_idx = None  # finished and gave its slot back before the worker wrote: the slot was taken already
    tokens.publish(slots, torch.tensor([11, 13]))
    ids = torch.tensor([4, placeholder(third), 9])
    assert tokens.resolve(ids).tolist() == [4, 13, 9]
    result = StepResult(next_ids={0: 11, 2: 13})
    tokens.settle(batch, result)
    assert result.next_ids == {0: 11, 2: 13} and tokens.unseen(first) == tokens.unseen(third) == 0


def test_a_token_sampled_before_jump_forward_is_dropped_and_no_longer_counted():
    tokens = FutureTokens(8, "cpu")
    older, newer = _batch(True), _batch(True)
    newer.slices[0].req = older.slices[0].req  # the same request in two launched batches
    req = older.slices[0].req
    tokens.reserve(older), tokens.reserve(newer)
    assert tokens.unseen(req) == 2
    tokens.settle(older, StepResult(next_ids={0: 3}))
    tokens.redirect(req)  # jump-forward changed it while `newer` runs
    assert tokens.unseen(req) == 0  # its next slice lays out no placeholder
    result = StepResult(next_ids={0: 8}, output_logprobs={0: -0.5})
    tokens.settle(newer, result)
    assert result.next_ids == {} and result.output_logprobs == {} and not tokens.stale


def test_redirect_without_a_token_in_flight_changes_nothing():
    tokens = FutureTokens(8, "cpu")
    batch = _batch(True)
    tokens.redirect(batch.slices[0].req)
    result = StepResult(next_ids={0: 1})
    tokens.reserve(batch)
    tokens.settle(batch, result)
    assert result.next_ids == {0: 1}


def test_plain_launcher_folds_each_batch_in_the_round_it_was_submitted():
    folded = []
    launcher = PlainLauncher(Runner(), lambda batch, result: folded.append(result.next_ids), lambda batch: 7)
    launcher.submit(_batch(True))
    assert folded == [{0: 7}] and not launcher.busy
    launcher.submit(None)
    assert folded == [{0: 7}]


def test_overlap_launcher_folds_a_batch_in_the_next_round_on_the_scheduler_thread():
    folded, inputs = [], iter([1, 2])
    runner = Runner()
    launcher = OverlapLauncher(runner, lambda batch, result: folded.append((batch, result.next_ids)),
                               lambda batch: next(inputs))
    first, second = _batch(True), _batch(True)
    launcher.submit(first)
    assert launcher.busy and folded == []
    launcher.submit(second)
    assert folded == [(first, {0: 1})]
    launcher.drain()
    assert folded[1] == (second, {0: 2}) and not launcher.busy
    assert set(runner.threads) == {threading.current_thread().name}  # prepare reads scheduler state
    launcher.close()


def test_overlap_launcher_errors_reach_the_scheduler_and_release_the_next_batch():
    def run(batch, inputs):
        if batch.slices[0].req.req_pool_idx == 0:
            raise ZeroDivisionError
        return StepResult(next_ids={0: inputs()})

    launcher = OverlapLauncher(Runner(run), lambda batch, result: None, lambda batch: 1)
    launcher.submit(_batch(True))
    waiting = _batch(True, first_slot=1)
    with pytest.raises(ZeroDivisionError):
        launcher.submit(waiting)  # folding the failed batch raises; the new one must not wait for inputs forever
    assert not launcher.busy
    launcher.close()


def test_closing_releases_a_worker_waiting_for_sampling_inputs():
    forward_done = threading.Event()

    def run(batch, inputs):
        forward_done.set()
        return inputs()  # sampling waits for the scheduler's masks

    launcher = OverlapLauncher(Runner(run), lambda batch, result: None, lambda batch: 1)
    launched = launcher.in_flight = launcher._launch(_batch(True))
    assert forward_done.wait(10)
    launcher.close()  # the scheduler stopped: the worker must not wait forever
    assert isinstance(launched.result.exception(timeout=10), RuntimeError)
