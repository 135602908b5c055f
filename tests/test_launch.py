"""launch.py without a model: future-token slots, and both launchers' hand-offs, including on errors."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from furcate.runtime.scheduler.batch import ScheduleBatch
from furcate.runtime.scheduler.launch import FUTURE_SLOTS, FutureTokens, InlineLauncher, WorkerLauncher, abandon


def _batch(*samples: bool) -> ScheduleBatch:
    reqs = [SimpleNamespace(future_slot=None, discard_next=False) for _ in samples]
    slices = [SimpleNamespace(req=r, samples=s) for r, s in zip(reqs, samples)]
    return ScheduleBatch(slices, forward=None, logit_ranges=[])


def test_future_tokens_round_trip_and_wrap_around():
    futures = FutureTokens()
    futures.next_slot = FUTURE_SLOTS - 1
    batch = _batch(True, False, True)
    futures.reserve(batch)
    first, _, third = (piece.req for piece in batch.slices)
    assert batch.future_slots == [FUTURE_SLOTS - 1, 0] and third.future_slot == 0
    ids = torch.tensor([5, FutureTokens.placeholder(first), 7, FutureTokens.placeholder(third)])
    futures.publish(batch, torch.tensor([11, 13]))
    assert futures.resolve(ids).tolist() == [5, 11, 7, 13]
    slots = iter(batch.future_slots)
    assert FutureTokens.settle(first, slots) and first.future_slot is None
    FutureTokens.redirect(third)  # jump-forward changed it while a later batch was in flight
    assert not FutureTokens.settle(third, slots) and not third.discard_next


def test_inline_launcher_runs_when_inputs_arrive_and_keeps_errors_for_the_completer():
    ran = []
    launcher = InlineLauncher(lambda batch, inputs: ran.append(inputs.result()) or "result")
    launched = launcher.launch(_batch(True))
    assert not ran
    launched.sampling_inputs.set_result("masks")
    assert ran == ["masks"] and launched.result.result() == "result"

    failing = InlineLauncher(lambda batch, inputs: 1 / 0).launch(_batch(True))
    failing.sampling_inputs.set_result(None)
    with pytest.raises(ZeroDivisionError):
        failing.result.result()


def test_abandon_releases_a_worker_waiting_for_sampling_inputs():
    forward_done = threading.Event()

    def run(batch, inputs):
        forward_done.set()
        return inputs.result()  # sampling waits for the scheduler's masks

    launcher = WorkerLauncher(run)
    launched = launcher.launch(_batch(True))
    assert forward_done.wait(10)
    abandon(launched)  # the scheduler stopped: the worker must not wait forever
    assert isinstance(launched.result.exception(timeout=10), RuntimeError)
    launcher.close()
