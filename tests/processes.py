"""Helpers for tests that run several processes: free ports, sglang-router, and finding a process's descendants."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_router(args: list[str]) -> tuple[subprocess.Popen, str]:
    """sglang-router on a free loopback port (its Prometheus exporter on another); returns it and its URL once
    it answers /health."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "warn", "--prometheus-port", str(free_port()),
                                *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "sglang-router did not start"
        time.sleep(0.2)


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
