"""Builds an engine's compiled decode graphs in a separate, low-priority process, while the engine serves.

Compiling the default model's three graphs takes ~100 s on 2 cores, too long to make every first start wait. By
default (enable_torch_compile unset) an engine whose graphs are not on disk yet decodes eagerly and starts this
builder: it loads the same model with the same kernel choices, compiles the graphs at nice 19, and saves them
(graph_cache.py); the engine loads them as they appear and decodes through them from then on, and every later start
loads them in seconds. The builder finishes its work even when the engine stops first, so the next start finds the
graphs; one build runs per key at a time (a lock file holding the builder's pid); FURCATE_AUTO_COMPILE=0 leaves
decode eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..cache.memory_pool import TokenToKVPool
from .compiled_decode import compile_graphs
from .graph_cache import complete, graph_dir, graph_key, load_graphs, save_graphs, use_furcate_inductor_cache
from .serving_model import load_serving_model

logger = logging.getLogger("furcate.graph_builder")

BUILD_TIMEOUT_S = 30 * 60  # a build still running then is stuck: the builder exits and the engine stays eager
POLL_S = 2.0
LOCK = "building.pid"
LOG = "build.log"
FAILED = "failed"  # written by a builder whose build raised: later starts do not try again (delete to retry)


def auto_compile_enabled() -> bool:
    """FURCATE_AUTO_COMPILE=0: with enable_torch_compile unset, decode stays eager (no graphs loaded or built)."""
    return os.environ.get("FURCATE_AUTO_COMPILE", "1") != "0"


@dataclass(frozen=True)
class BuildSpec:
    """What the builder needs to load the engine's model as the engine did, and the key it must arrive at."""

    model_path: str
    dtype: str  # torch's name: "bfloat16"
    quantization: str
    quantized_rows: int  # quantization=auto's measured row limit, reused rather than measured again
    pool: tuple[int, int, int]  # the KV pool's layers, KV heads, head size
    sizes: tuple[int, ...]
    threads: int
    key: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BuildSpec:
        fields = json.loads(text)
        return cls(**{**fields, "pool": tuple(fields["pool"]), "sizes": tuple(fields["sizes"])})


def start_background_build(spec: BuildSpec) -> BackgroundGraphs | None:
    """A builder for spec's graphs, unless one failed for them before or none can start (decode stays eager)."""
    failed = graph_dir(spec.key) / FAILED
    if failed.exists():
        logger.info("decode runs eagerly: building its graphs failed before (%s; delete %s to try again)",
                    failed.read_text(errors="replace").strip()[-300:], failed.parent)
        return None
    try:
        return BackgroundGraphs(spec)
    except OSError as error:  # a read-only cache folder, no room for a process
        logger.warning("decode runs eagerly: its graphs' builder did not start: %s", error)
        return None


class BackgroundGraphs:
    """Starts the builder and watches for its graphs; `graphs` is set, on a watcher thread, once they load."""

    def __init__(self, spec: BuildSpec) -> None:
        self.spec, self.folder = spec, graph_dir(spec.key)
        self.graphs: dict[int, object] | None = None
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / LOG).open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", f"{__package__}.graph_builder", spec.to_json()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, process_group=0)
        logger.warning("decode runs eagerly until its compiled graphs are built: building them in the background "
                       "(pid %d, at low priority; log %s); later starts load them",
                       self.process.pid, self.folder / LOG)
        threading.Thread(target=self._watch, name="furcate-graph-watch", daemon=True).start()

    def _watch(self) -> None:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while time.monotonic() < deadline:
            exit_code = self.process.poll()
            if complete(self.folder, list(self.spec.sizes)):
                self.graphs = load_graphs(self.folder, list(self.spec.sizes))
                return
            if exit_code not in (None, 0) or (exit_code == 0 and not holder_alive(self.folder / LOCK)):
                logger.warning("building the compiled decode graphs failed (exit code %s); decode stays eager: "
                               "see %s", exit_code, self.folder / LOG)
                return
            time.sleep(POLL_S)


def holder_alive(lock: pathlib.Path) -> bool:
    try:
        os.kill(int(lock.read_text()), 0)
    except (OSError, ValueError):  # gone, or a half-written or foreign file
        return False
    return True


@contextlib.contextmanager
def build_lock(folder: pathlib.Path) -> Iterator[bool]:
    """Whether this process holds the folder's build lock (False: another live builder does); a lock left by a
    builder that died is taken over."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if holder_alive(lock):
                break
            lock.unlink(missing_ok=True)
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        try:
            yield True
        finally:
            lock.unlink(missing_ok=True)
        return
    yield False


def build(spec: BuildSpec) -> int:
    """The builder's work; its exit code."""
    folder = graph_dir(spec.key)
    with build_lock(folder) as mine:
        if not mine or complete(folder, list(spec.sizes)):
            return 0
        dtype = getattr(torch, spec.dtype)
        model, _ = load_serving_model(spec.model_path, dtype, spec.quantization, graphs=True,
                                      quantized_rows=spec.quantized_rows)
        layers, kv_heads, head_dim = spec.pool
        pool = TokenToKVPool(16, layers, kv_heads, head_dim, dtype, "cpu")
        key = graph_key(model, pool, list(spec.sizes))
        if key != spec.key:
            print(f"the model loaded here has key {key}, the engine's {spec.key}: not building", file=sys.stderr)
            return 2
        save_graphs(folder, compile_graphs(model, pool, list(spec.sizes)))
    return 0


def lower_priority() -> None:
    """Take only what the engine leaves idle: SCHED_IDLE and nice 19, inherited by the compiler processes it runs.
    The builder stays in the engine's session (a process group of its own, so it outlives the engine and a
    terminal's Ctrl-C), hence in its autogroup: with the kernel's autogroups on, CPU is shared between groups first,
    and a builder in a group of its own took half the CPU whatever its policy (the engine's 2-thread steps,
    waiting at each op for a preempted thread, ran 10-40x slower)."""
    os.nice(19)
    with contextlib.suppress(OSError, AttributeError):  # SCHED_IDLE is Linux's
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main() -> int:
    lower_priority()
    signal.alarm(BUILD_TIMEOUT_S)  # never outlive a stuck compile
    logging.basicConfig(level=logging.INFO)
    spec = BuildSpec.from_json(sys.argv[1])
    torch.set_num_threads(spec.threads)
    use_furcate_inductor_cache()
    try:
        return build(spec)
    except Exception as error:  # e.g. no C++ compiler for inductor: the same would fail at every start
        (graph_dir(spec.key) / FAILED).write_text(f"{type(error).__name__}: {error}")
        raise


if __name__ == "__main__":
    sys.exit(main())
