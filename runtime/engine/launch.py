"""Starting the scheduler's process (scheduler/process.py), and, when asked, keeping a spare one ready.

A fresh scheduler spends most of its start importing torch and transformers (~1.5 s of a tiny model's ~2.5 s).
A caller that starts engine after engine (a test suite, a benchmark, a notebook re-creating its engine) can ask
for a spare: after each successful start one more process is launched, imports in the background and waits for its
arguments, and the next engine takes it. It is off by default, since a single engine would pay for an idle
process's memory and import CPU. A spare launched under other environment variables or in another working
directory than the caller's at take time is not used (its interpreter read the old ones, and a relative model
path would name another folder), nor is one that has exited.
"""

from __future__ import annotations

import atexit
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener

from ..wire.process_start import AUTHKEY_ENV, PREIMPORT_FLAG, SCHEDULER_MODULE


@dataclass
class Launched:
    """A scheduler process and its connection, accepted on a background thread."""

    process: subprocess.Popen
    surroundings: tuple[dict[str, str], str]  # the environment and working directory it started in
    _accepted: list[Connection] = field(default_factory=list)
    _acceptor: threading.Thread | None = None

    def connection(self) -> Connection:
        """The accepted connection; a process that exits before connecting is an error."""
        while self._acceptor.is_alive() and self.process.poll() is None:
            self._acceptor.join(timeout=0.2)
        if not self._accepted:
            self.process.kill()
            raise RuntimeError(f"scheduler process exited with code {self.process.wait()} before connecting")
        return self._accepted[0]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


_spare: Launched | None = None
_spare_lock = threading.Lock()
_keep_spare = False


def keep_a_spare_scheduler(keep: bool = True) -> None:
    """After each engine start, launch the next engine's scheduler process ahead of time (see the module doc)."""
    global _keep_spare
    if not isinstance(keep, bool):
        raise TypeError(f"keep must be True or False, got {keep!r}")
    _keep_spare = keep
    if not keep:
        _drop_spare()


def start_scheduler_process() -> tuple[subprocess.Popen, Connection]:
    """A scheduler process (the spare, when one is usable) and its authenticated connection."""
    launched = _take_spare() or launch(preimport=False)
    return launched.process, launched.connection()


def started_one() -> None:
    """An engine is serving: launch the next one's spare now, so that it never slows this start nor outlives a
    start that failed."""
    if _keep_spare:
        _set_spare(launch(preimport=True))


def launch(preimport: bool) -> Launched:
    """Start `python -m furcate.runtime.scheduler.process ADDRESS`; a spare imports before it is handed work."""
    authkey = secrets.token_bytes(32)
    listener = Listener(family="AF_UNIX", authkey=authkey)
    command = [sys.executable, "-m", SCHEDULER_MODULE, listener.address]
    process = subprocess.Popen(command + ([PREIMPORT_FLAG] if preimport else []),
                               env=dict(os.environ, **{AUTHKEY_ENV: authkey.hex()}))
    launched = Launched(process, _surroundings())

    def accept() -> None:
        with listener:
            try:
                launched._accepted.append(listener.accept())
            except (OSError, EOFError, AuthenticationError):  # it died, or was stopped, mid-handshake
                return  # connection() reports it; a spare dropped meanwhile needs nothing more

    launched._acceptor = threading.Thread(target=accept, daemon=True, name="furcate-scheduler-accept")
    launched._acceptor.start()
    return launched


def _surroundings() -> tuple[dict[str, str], str]:
    return dict(os.environ), os.getcwd()


def _take_spare() -> Launched | None:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    if spare.surroundings == _surroundings() and spare.process.poll() is None:
        return spare
    spare.stop()
    return None


def _set_spare(launched: Launched) -> None:
    global _spare
    with _spare_lock:
        previous, _spare = _spare, launched
    if previous is not None:
        previous.stop()


def _drop_spare() -> None:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        spare.stop()


atexit.register(_drop_spare)
