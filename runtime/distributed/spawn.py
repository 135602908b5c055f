"""Start the follower ranks' interpreters. Torch-free, so the scheduler process can start them before its own
heavy imports, and both import torch and the model code at once."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection


@dataclass
class Spawned:
    """Follower processes (ranks 1..n, in order) and rank 0's end of each one's private pipe."""

    processes: list[subprocess.Popen] = field(default_factory=list)
    pipes: list[Connection] = field(default_factory=list)


def spawn_followers(count: int) -> Spawned:
    """`python -m furcate.runtime.executor.tp_follower FD` per rank, each holding one end of a socketpair (no
    listener, no key: nobody else can reach it, and it closes when either side exits)."""
    spawned = Spawned()
    for _ in range(count):
        ours, theirs = socket.socketpair()
        with theirs:
            command = [sys.executable, "-m", "furcate.runtime.executor.tp_follower", str(theirs.fileno())]
            spawned.processes.append(subprocess.Popen(command, pass_fds=[theirs.fileno()]))
        spawned.pipes.append(Connection(ours.detach()))
    return spawned
