"""Helpers for tests that run several processes: free ports, sglang-router, and finding a process's descendants."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from furcate.runtime.server.data_parallel import wait_router_ready


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_router(args: list[str], num_workers: int) -> tuple[subprocess.Popen, str]:
    """sglang-router on a free loopback port (its Prometheus exporter on another); returns it and its URL once it
    lists all `num_workers` workers as healthy (its /health answers before it has registered them)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "warn", "--prometheus-port", str(free_port()),
                                *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_router_ready(url, process, num_workers)
    except BaseException:
        process.kill()
        raise
    return process, url


def descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def running(pids: set[int]) -> set[int]:
    """The pids among these that still run (zombies, exited but not yet reaped by their parent, do not)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def wait_gone(pids: set[int], timeout: float = 20) -> set[int]:
    """Waits up to `timeout` for these processes to end; returns those still running."""
    deadline = time.monotonic() + timeout
    while (alive := running(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive
