"""How the caller's process starts the scheduler's (engine/launch.py starts it, scheduler/process.py is it): the
module run, where the connection's key travels, and the flag of a spare that imports before its arguments come."""

from __future__ import annotations

SCHEDULER_MODULE = "furcate.runtime.scheduler.process"
AUTHKEY_ENV = "FURCATE_SCHEDULER_AUTHKEY"
# A spare process (engine/launch.py) imports what a scheduler needs before its arguments come; a process started
# for an engine imports after, so that tensor-parallel followers start importing at the same time.
PREIMPORT_FLAG = "--import-first"
