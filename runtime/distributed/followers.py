"""Rank 0's side of tensor parallelism: start the follower ranks, join the group with them, drive their steps,
and stop them.

Each follower is a fresh interpreter, like the scheduler process, holding one end of a private socketpair
(spawn.py). That pipe carries start-up (arguments in, ready or a traceback out), one small header per step, and
the stop message; collectives carry the tensors. A follower waits for its next step on the pipe, not in a
collective, so an idle server never times a collective out, and a follower whose rank 0 is gone sees the pipe
close and exits.
"""

from __future__ import annotations

import dataclasses
import subprocess
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..attention.base import ForwardBatch
from ..config import EngineArgs
from .parallel_state import TensorParallel, create_store, join_group, leave_group, rank_device
from .spawn import Spawned
from .step_sync import send_step, snapshot_table

STOP_TIMEOUT_S = 10


@dataclass
class FollowerStart:
    """Rank 0 -> follower, first message: what to load and where to join."""

    args: EngineArgs  # max_total_tokens resolved by rank 0, so every rank's KV pool has the same slots
    model_path: str
    rank: int
    store_port: int


@dataclass
class FollowerFailed:
    """Follower -> rank 0, instead of "ready": start-up failed."""

    traceback: str


@dataclass
class FollowerCall:
    """Rank 0 -> follower between steps: run RankControl.<method>(*args) on your rank (executor/rank_control.py)."""

    method: str
    args: tuple


@dataclass
class FollowerReply:
    """Follower -> rank 0: a FollowerCall's result, or the error it raised (message)."""

    value: object = None
    error: str | None = None


class NoFollowers:
    """The model runner's followers when it runs alone (one rank, or a follower itself): nobody to tell."""

    def wait_ready(self) -> None:
        """Nobody to wait for."""

    def snapshot(self, forward: ForwardBatch) -> None:
        """Nobody reads the request table but this rank."""

    def run_step(self, forward: ForwardBatch, logit_rows: torch.Tensor) -> None:
        """Nobody runs the forward alongside."""

    def start_call(self, method: str, *args: object) -> None:
        """Nobody to call."""

    def finish_call(self) -> list[object]:
        return []

    def close(self, kill: bool = False) -> None:
        """Nothing to stop."""


class Followers:
    """The tp_size - 1 follower processes of a rank-0 scheduler, told what to load and joined to the group on
    creation."""

    def __init__(self, args: EngineArgs, model_path: str, spawned: Spawned) -> None:
        self.processes, self.pipes = spawned.processes, spawned.pipes
        self.device = args.device
        try:
            store = create_store(args.tp_size)
            for rank, pipe in enumerate(self.pipes, start=1):
                start_args = dataclasses.replace(args, device=rank_device(args.device, rank))
                self._send(rank, pipe, FollowerStart(start_args, model_path, rank, store.port))
            self._join(TensorParallel(0, args.tp_size), args.device, store)
        except BaseException:
            self.close(kill=True)
            raise

    def _join(self, tp: TensorParallel, device: str, store: dist.TCPStore) -> None:
        """Join the group while watching the followers: one that dies before joining must fail start-up at once,
        not leave rank 0 waiting out the rendezvous timeout."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                join_group(tp, device, store)
            except BaseException as error:  # noqa: BLE001 - re-raised on the starting thread
                failure.append(error)

        joiner = threading.Thread(target=join, daemon=True, name="furcate-tp-join")
        joiner.start()
        while joiner.is_alive():
            joiner.join(timeout=0.1)
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    raise self._start_error(rank)
        if failure:
            raise failure[0]

    def wait_ready(self) -> None:
        """Block until every follower has loaded its shard and built its pools."""
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                message = pipe.recv()
            except (EOFError, OSError):
                raise self._start_error(rank) from None
            if message != "ready":
                raise self._start_error(rank, message)

    def _send(self, rank: int, pipe: Connection, message: FollowerStart) -> None:
        try:
            pipe.send(message)
        except OSError:
            raise self._start_error(rank) from None

    def _start_error(self, rank: int, message: object = None) -> RuntimeError:
        """The clearest account of a follower's failed start: its traceback if it sent one, else its exit code."""
        pipe, process = self.pipes[rank - 1], self.processes[rank - 1]
        if message is None:
            try:
                message = pipe.recv() if pipe.poll() else None
            except (EOFError, OSError):
                message = None
        if isinstance(message, FollowerFailed):
            return RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{message.traceback}")
        try:
            code = process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code} during "
                            "start-up (see its stderr)")

    def snapshot(self, forward: ForwardBatch) -> None:
        """Take the request-table entries this forward sends, on the scheduler thread, which edits the table."""
        snapshot_table(forward)

    def run_step(self, forward: ForwardBatch, logit_rows: torch.Tensor) -> None:
        """Hand the followers this forward; they run it alongside rank 0 (every collective needs every rank)."""
        try:
            send_step(forward, logit_rows, self.pipes, self.device)
        except OSError as error:
            gone = [f"rank {rank} (exit code {p.poll()})" for rank, p in enumerate(self.processes, start=1)
                    if p.poll() is not None]
            raise RuntimeError(f"tensor-parallel {', '.join(gone) or 'rank'} is gone; the model cannot run "
                               "without it") from error

    def start_call(self, method: str, *args: object) -> None:
        """Have every follower start RankControl.<method>(*args); rank 0 runs its own part, then finish_call()."""
        for pipe in self.pipes:
            pipe.send(FollowerCall(method, args))

    def finish_call(self) -> list[object]:
        """Every follower's result of the call started; RuntimeError naming the first rank that failed (after all
        replied, so the pipes stay in step)."""
        replies = [pipe.recv() for pipe in self.pipes]
        for rank, reply in enumerate(replies, start=1):
            if reply.error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank}: {reply.error}")
        return [reply.value for reply in replies]

    def close(self, kill: bool = False) -> None:
        """Stop every follower (asked first, killed if it does not go; killed at once after a failed start, when
        some may still wait in the rendezvous), then leave the group."""
        for pipe, process in zip(self.pipes, self.processes):
            try:
                if kill:
                    process.kill()
                else:
                    pipe.send(None)
            except OSError:
                pass  # already gone
        for process in self.processes:
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in self.pipes:
            pipe.close()
        self.processes, self.pipes = [], []
        leave_group()
