"""C kernels built once per machine with the system compiler, for the CPU they run on, and cached on disk.

A kernel's library is keyed by its source, the compiler, the flags and the CPU (-march=native compiles for the
CPU at hand), so another machine, flag set or edit builds its own. It is compiled into a temporary file and
moved into place, so a concurrent start never loads half a file. Without a compiler, or where the build fails,
load raises OSError or SubprocessError and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import subprocess
import tempfile
from collections.abc import Callable

from .cache_folder import furcate_cache

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> pathlib.Path:
    return furcate_cache() / "kernels"


def cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def library_path(source: pathlib.Path, compiler: str, flags: tuple[str, ...]) -> pathlib.Path:
    key = hashlib.sha256("\0".join([source.read_text(), compiler, *flags, cpu_signature()]).encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: pathlib.Path, compiler: str, flags: tuple[str, ...], target: pathlib.Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = pathlib.Path(scratch) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(built, target)


def load(source: pathlib.Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """source built with FLAGS and extra_flags ($CC, else cc), building it if needed."""
    compiler, flags = os.environ.get("CC", "cc"), FLAGS + extra_flags
    target = library_path(source, compiler, flags)
    if not target.exists():
        build(source, compiler, flags, target)
    return ctypes.CDLL(str(target))


def failure_reason(error: OSError | subprocess.SubprocessError) -> str:
    """What a failed build or load says: the compiler's errors where it ran."""
    return (getattr(error, "stderr", None) or str(error)).strip()


def load_or_reason(variable: str, load: Callable[[], ctypes.CDLL], logger: logging.Logger,
                   fallback: str) -> ctypes.CDLL | str:
    """load()'s library, or why there is none: turned off by `variable`=0, or its build or load failed (logged
    as a warning that names the `fallback` running instead)."""
    if os.environ.get(variable, "1") == "0":
        return f"turned off by {variable}=0"
    try:
        return load()
    except (OSError, subprocess.SubprocessError) as error:
        reason = failure_reason(error)
        logger.warning("%s: %s", fallback, reason)
        return f"could not build or load it: {reason}"
