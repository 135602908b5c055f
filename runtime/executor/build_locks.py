"""The locks that keep compiled-graph builds in check: one build per graph key, and at most FURCATE_MAX_BUILDERS
background builders on a machine at once (a slot each, in the cache folder).

Each lock is an flock on a file, taken without waiting by the engine before it starts a builder, and handed to
the builder as an inherited descriptor. The lock belongs to the open file, so it is held while either process
keeps it open and the kernel drops it when the last holder exits, however it exits: no pid file to judge stale.
The file holds the pid of the process building, for messages only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from collections.abc import Callable

from ..cache_folder import furcate_cache

KEY_LOCK = "building.lock"
MAX_BUILDERS_ENV = "FURCATE_MAX_BUILDERS"
# One: a builder takes only idle CPU, so two split the same idle cores and each holds its model (~400 MB).
DEFAULT_MAX_BUILDERS = 1


def max_builders() -> int:
    """$FURCATE_MAX_BUILDERS (an integer >= 1), else DEFAULT_MAX_BUILDERS."""
    text = os.environ.get(MAX_BUILDERS_ENV, str(DEFAULT_MAX_BUILDERS))
    with contextlib.suppress(ValueError):
        if int(text) >= 1:
            return int(text)
    raise ValueError(f"{MAX_BUILDERS_ENV} must be an integer >= 1, got {text!r}")


def key_lock(folder: pathlib.Path) -> pathlib.Path:
    """The lock of the build of the graphs kept in folder."""
    return folder / KEY_LOCK


def slot_locks() -> list[pathlib.Path]:
    """The machine's builder slots (per cache folder: the one place every engine of this user looks)."""
    return [furcate_cache() / "builders" / f"slot{i}.lock" for i in range(max_builders())]


def try_lock(path: pathlib.Path) -> int | None:
    """A descriptor (close-on-exec) holding path's lock, or None while another open file holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    note_holder(fd, os.getpid())
    return fd


def take_slot() -> int | None:
    """A descriptor holding a free builder slot, or None when every slot is taken."""
    for path in slot_locks():
        fd = try_lock(path)
        if fd is not None:
            return fd
    return None


def note_holder(fd: int, pid: int) -> None:
    """Write the pid of the process the lock now works for (read back by holder, for messages)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(pid).encode(), 0)


def holder(path: pathlib.Path) -> str:
    """The pid the lock file names, as text ("?" where it names none)."""
    with contextlib.suppress(OSError):
        text = path.read_text().strip()
        if text.isdigit():
            return text
    return "?"


def wait_lock(path: pathlib.Path, waiting: Callable[[str], None]) -> int:
    """A descriptor holding path's lock, waited for; waiting(the holder's pid) is called first when another
    process holds it."""
    fd = try_lock(path)
    if fd is not None:
        return fd
    waiting(holder(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    note_holder(fd, os.getpid())
    return fd
