"""`ServerProcess` starts `python -m furcate serve` as a child and waits until it is ready (used by furcate.Runtime,
tests, benchmarks); the ready line it waits for is the one serve.py prints."""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ..config import EngineArgs

READY_PREFIX = "furcate server ready at "


def url_host(host: str) -> str:
    """A host as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


class ServerProcess:
    """`python -m furcate serve` in a child process; `.url` once it printed its ready line. `launcher` is the
    command that runs furcate's CLI: by default this interpreter's furcate, or another environment's `furcate`
    console script."""

    def __init__(self, model_path: str = "default", engine_args: dict[str, Any] | None = None,
                 host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 extra_args: tuple[str, ...] = (), startup_timeout: float = 600.0,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "furcate")) -> None:
        command = [*launcher, "serve", "--model-path", model_path, "--host", host,
                   "--port", str(port), *cli_flags(engine_args or {}), *extra_args]
        if api_key is not None:
            command += ["--api-key", api_key]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.output: list[str] = []  # the child's stdout lines, kept for error messages
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True, name="furcate-server-stdout").start()
        self.url = self._wait_ready(startup_timeout)

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"the furcate server did not start within {timeout:.0f}s") from None
            if line is None:
                code = self.process.wait()
                raise RuntimeError(f"the furcate server exited with code {code} before it was ready")
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].strip()
            sys.stdout.write(line)  # pass the child's other output through

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful), then SIGKILL if it has not exited within `timeout`; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def cli_flags(engine_args: dict[str, Any]) -> list[str]:
    """EngineArgs keywords as `furcate serve` flags (`--no-flag` for a false boolean)."""
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    flags: list[str] = []
    for name, value in engine_args.items():
        if name not in fields or name == "model_path":
            raise ValueError(f"unknown engine argument {name!r}")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags
