"""Build an outlines-core Index in a child process under a time and memory limit.

outlines-core turns a JSON schema into a regex and a regex into a token-level DFA; for some schemas either step takes
minutes and tens of GB. A thread cannot stop a compile that is inside Rust, so both run in a process that can be
killed. The child is this file run as a script: it imports only outlines_core (no torch, no furcate, which is also
why it reads /proc itself rather than sharing the runtime's helper), so it starts in ~30 ms, and it is a fresh
interpreter, so neither the scheduler's threads nor a user's unguarded script are forked or re-run.
"""

from __future__ import annotations

import pickle
import resource
import subprocess
import sys


class CompileLimitExceeded(ValueError):
    """The compile ran out of time or memory; a ValueError so it fails its request like any bad spec."""


def build_index_isolated(kind: str, source: str, vocabulary, timeout_s: float, memory_limit_bytes: int):
    """outlines_core.Index for a regex or a JSON schema (`kind` "regex" or "json_schema"), built in a child.
    Raises CompileLimitExceeded past either limit and ValueError when outlines-core rejects the source."""
    request = pickle.dumps((memory_limit_bytes, kind, source, vocabulary))
    try:
        done = subprocess.run([sys.executable, "-I", __file__], input=request, capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:  # run() has killed the child
        raise CompileLimitExceeded(f"did not compile within {timeout_s:g}s") from None
    limit = f"{memory_limit_bytes / 2**30:g} GiB"
    if done.returncode != 0:  # Rust's allocator aborts when the address-space limit is hit
        raise CompileLimitExceeded(f"the compile process died, most likely past its {limit} memory limit")
    ok, value = pickle.loads(done.stdout)
    if ok:
        return value
    if value == "MemoryError":
        raise CompileLimitExceeded(f"compiling needed more than {limit} of memory")
    raise ValueError(value)


def _virtual_memory_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read VmSize from /proc/self/status")


def _child() -> None:
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    memory_limit_bytes, kind, source, vocabulary = pickle.loads(sys.stdin.buffer.read())
    # On top of what the interpreter already maps, so the limit bounds the compile's own allocations.
    limit = _virtual_memory_bytes() + memory_limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        regex = build_regex_from_schema(source) if kind == "json_schema" else source
        result = (True, Index(regex, vocabulary))
    except MemoryError:
        result = (False, "MemoryError")
    except Exception as error:  # outlines-core's rejection, named, goes back to the caller
        result = (False, f"{type(error).__name__}: {error}")
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    _child()
