"""Builds an engine's compiled decode graphs in a separate, low-priority process while the engine serves, and
never lets that process outlive the engine.

Compiling the default model's three graphs takes ~100 s on 2 cores, too long to make every first start wait. By
default (enable_torch_compile unset) an engine whose graphs are not on disk yet decodes eagerly, and a watcher
thread (BackgroundGraphs) starts this builder: it loads the same model with the same kernel choices, compiles the
graphs at SCHED_IDLE and nice 19, and saves each as it is done (graph_cache.py). The engine loads them once all are
there and decodes through them from then on; every later start loads them in seconds.

The engine takes the key's lock and a machine-wide builder slot (build_locks.py) before it starts a builder, and
hands both over: a second engine on the same key waits for the first one's graphs instead of building them again,
and at most FURCATE_MAX_BUILDERS builders run at once. The builder goes with its engine: the engine kills its
process group (the builder and the compilers it runs) when it closes, and when the builder got less than
MIN_CPU_SHARE of a core over STALL_S (a machine never idle gives SCHED_IDLE nothing); the kernel kills it
(parent-death signal) if the engine's process ends any other way. A build stopped half-way keeps the graphs it
finished. To have the graphs whatever the load, build them ahead of time with `furcate prepare` (it waits), or
compile at start-up with enable_torch_compile=True. FURCATE_AUTO_COMPILE=0 leaves decode eager.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..cache.memory_pool import TokenToKVPool
from ..model import kernel_choice
from .build_locks import holder, key_lock, max_builders, note_holder, take_slot, try_lock
from .compiled_decode import compile_graphs
from .graph_cache import (
    complete,
    graph_dir,
    graph_file,
    graph_key,
    load_graphs,
    prune_unused,
    save_graph,
    use_furcate_inductor_cache,
)
from .serving_model import load_serving_model

logger = logging.getLogger("furcate.graph_builder")

BUILD_TIMEOUT_S = 30 * 60  # a build still running then is stuck: the builder exits and the engine stays eager
POLL_S = 2.0
# A builder that got less than this share of a core over STALL_S is stopped: at that pace the default model's
# build (~200 CPU seconds) would take over an hour, holding its memory all along.
STALL_S = 5 * 60.0
MIN_CPU_SHARE = 0.05
LOG = "build.log"
FAILED = "failed"  # written by a builder whose build raised: later starts do not try again (delete to retry)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
    """A watcher that builds spec's graphs, unless building them failed before or the cache folder is read-only
    (decode stays eager)."""
    failed = graph_dir(spec.key) / FAILED
    if failed.exists():
        logger.info("decode runs eagerly: building its graphs failed before (%s; delete %s to try again)",
                    failed.read_text(errors="replace").strip()[-300:], failed.parent)
        return None
    try:
        return BackgroundGraphs(spec)
    except OSError as error:
        logger.warning("decode runs eagerly: its graphs cannot be built here: %s", error)
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds a process and its reaped children used (/proc; None without it, or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return sum(int(ticks) for ticks in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@dataclass
class ProgressCheck:
    """Whether a builder still moves: over each STALL_S it must use MIN_CPU_SHARE of a core."""

    pid: int
    since: float = field(default_factory=time.monotonic)
    cpu: float = 0.0  # a builder just started has used none

    def stalled(self) -> bool:
        """Whether the STALL_S just ended gave the builder too little CPU (False in between, and without /proc,
        where BUILD_TIMEOUT_S alone bounds it)."""
        now, cpu = time.monotonic(), cpu_seconds(self.pid)
        if now - self.since < STALL_S or cpu is None:
            return False
        moved = cpu - self.cpu >= MIN_CPU_SHARE * (now - self.since)
        self.since, self.cpu = now, cpu
        return not moved


class BackgroundGraphs:
    """The engine's side of a background build: a watcher thread that starts the builder once the key's lock and
    a builder slot are free (another engine's build of the same key is waited for, and its graphs taken), sets
    `graphs` once they are all saved and load, and kills the builder when the engine closes (stop()) or when it
    stops progressing."""

    def __init__(self, spec: BuildSpec) -> None:
        self.spec, self.folder = spec, graph_dir(spec.key)
        self.graphs: dict[int, object] | None = None
        self.process: subprocess.Popen | None = None
        self.progress: ProgressCheck | None = None
        self.said: set[str] = set()
        self.closing = threading.Event()
        max_builders()  # a bad FURCATE_MAX_BUILDERS fails the start, not the watcher
        self.folder.mkdir(parents=True, exist_ok=True)
        self.thread = threading.Thread(target=self._watch, name="furcate-graph-watch", daemon=True)
        self.thread.start()

    def pending(self) -> bool:
        """Whether the graphs may still arrive (or have, and wait to be adopted)."""
        return self.graphs is not None or self.thread.is_alive()

    def stop(self) -> None:
        """The engine is closing: stop watching and kill the builder; returns once it is gone."""
        self.closing.set()
        self.thread.join()

    def _watch(self) -> None:
        """Runs until the graphs load, the build fails or stalls, or the engine closes; the builder goes then."""
        try:
            while not self._step():
                self.closing.wait(POLL_S)
        finally:
            self._kill()

    def _step(self) -> bool:
        """One look at the build; True when there is nothing more to watch."""
        exit_code = None if self.process is None else self.process.poll()
        if self.closing.is_set():
            return True
        if complete(self.folder, list(self.spec.sizes)):
            self.graphs = load_graphs(self.folder, list(self.spec.sizes))
            return True
        if exit_code is not None:
            return self._failed(exit_code)
        if self.process is None:
            return self._try_start()
        return self._stalled()

    def _try_start(self) -> bool:
        """Start the builder holding the key's lock and a slot, if both are free (else wait, said once); True
        when it cannot start at all."""
        with contextlib.ExitStack() as held:
            key_fd = try_lock(key_lock(self.folder))
            if key_fd is None:
                return self._waiting("another process (pid %s) builds these graphs: they are loaded when it is done",
                                     holder(key_lock(self.folder)))
            held.callback(os.close, key_fd)
            slot_fd = take_slot()
            if slot_fd is None:
                return self._waiting("%d graph builders already run on this machine (FURCATE_MAX_BUILDERS): this "
                                     "one starts when one ends", max_builders())
            held.callback(os.close, slot_fd)
            if not complete(self.folder, list(self.spec.sizes)):  # else built while this engine looked
                return self._spawn(key_fd, slot_fd)
        return False

    def _spawn(self, key_fd: int, slot_fd: int) -> bool:
        """The builder, handed both locks; True (give up) when no process can start."""
        command = [sys.executable, "-m", f"{__package__}.graph_builder", self.spec.to_json(), "--engine",
                   str(os.getpid())]
        try:
            with (self.folder / LOG).open("ab") as log:
                # One compiler process at a time, the builder's own child: inductor's worker pool would be
                # another ~300 MB process that outlives a killed builder by up to a minute.
                self.process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, process_group=0,
                    pass_fds=(key_fd, slot_fd), env={"TORCHINDUCTOR_COMPILE_THREADS": "1", **os.environ})
        except OSError as error:  # no room for a process, a read-only log
            logger.warning("decode runs eagerly: its graphs' builder did not start: %s", error)
            return True
        for fd in (key_fd, slot_fd):
            note_holder(fd, self.process.pid)
        self.progress = ProgressCheck(self.process.pid)
        logger.warning("decode runs eagerly until its compiled graphs are built: building them in the background "
                       "(pid %d, on idle CPU only; log %s); it stops with this engine, and later starts load "
                       "the graphs (`furcate prepare` builds them ahead of time)", self.process.pid,
                       self.folder / LOG)
        return False

    def _waiting(self, message: str, *values: object) -> bool:
        if message not in self.said:
            self.said.add(message)
            logger.warning("decode runs eagerly meanwhile: " + message, *values)
        return False

    def _failed(self, exit_code: int) -> bool:
        why = f"it ran past {BUILD_TIMEOUT_S // 60} minutes" if exit_code == -signal.SIGALRM else \
            f"exit code {exit_code}"
        logger.warning("building the compiled decode graphs failed (%s); decode stays eager: see %s", why,
                       self.folder / LOG)
        return True

    def _stalled(self) -> bool:
        if not self.progress.stalled():
            return False
        logger.warning("the compiled decode graphs' builder got less than %d%% of a core over %d s (it takes only "
                       "idle CPU, and this machine is busy): stopped; decode stays eager. Build the graphs ahead of "
                       "time with `furcate prepare` and this engine's options, or start with "
                       "enable_torch_compile=True", MIN_CPU_SHARE * 100, STALL_S)
        return True

    def _kill(self) -> None:
        """Kill the builder's process group (it and the compiler it runs) and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def build(spec: BuildSpec) -> int:
    """The builder's work, the key's lock held: the graphs not saved yet, each saved as it is done; its exit
    code."""
    folder = graph_dir(spec.key)
    missing = [bs for bs in spec.sizes if not graph_file(folder, bs).is_file()]
    if not missing:
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
    compile_graphs(model, pool, list(spec.sizes), missing, functools.partial(save_graph, folder))
    prune_unused(folder.parent)
    return 0


def lower_priority() -> None:
    """Take only what the engine leaves idle: SCHED_IDLE and nice 19, inherited by the compiler processes it runs.
    The builder stays in the engine's session (a process group of its own, which the engine kills whole), hence in
    its autogroup: with the kernel's autogroups on, CPU is shared between groups first, and a builder in a group
    of its own took half the CPU whatever its policy (the engine's 2-thread steps, waiting at each op for a
    preempted thread, ran 10-40x slower)."""
    os.nice(19)
    with contextlib.suppress(OSError, AttributeError):  # SCHED_IDLE is Linux's
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def die_with(engine_pid: int) -> None:
    """Exit when the engine's process does: by the kernel's parent-death signal where there is one, else a
    thread that polls for the parent."""
    armed = parent_death_signal()
    if os.getppid() != engine_pid:  # the engine went before the signal was armed
        os._exit(0)
    if not armed:
        threading.Thread(target=poll_parent, args=(engine_pid,), daemon=True).start()


def parent_death_signal() -> bool:
    """Linux: SIGKILL from the kernel when the engine's thread that started this process ends. It needs no CPU
    here, where SCHED_IDLE on a busy machine may get none (a polling thread would never run)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def poll_parent(engine_pid: int) -> None:
    while os.getppid() == engine_pid:
        time.sleep(POLL_S)
    os.killpg(0, signal.SIGKILL)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="graph_builder", description="build an engine's compiled decode graphs")
    parser.add_argument("spec", type=BuildSpec.from_json, help="the BuildSpec, as JSON")
    parser.add_argument("--engine", type=int, help="the engine process that holds this build's locks for it")
    return parser.parse_args(argv)


@contextlib.contextmanager
def key_lock_for(spec: BuildSpec, engine_pid: int | None) -> Iterator[bool]:
    """Whether this process may build: an engine handed it the key's lock, or (run by hand) it took it."""
    if engine_pid is not None:
        yield True
        return
    fd = try_lock(key_lock(graph_dir(spec.key)))
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.engine is not None:
        die_with(args.engine)
    lower_priority()
    signal.alarm(BUILD_TIMEOUT_S)  # never outlive a stuck compile
    kernel_choice.MEASURE_PROVISIONAL = False
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.spec.threads)
    use_furcate_inductor_cache()
    with key_lock_for(args.spec, args.engine) as mine:
        if not mine:
            print("another process builds these graphs", file=sys.stderr)
            return 0
        try:
            return build(args.spec)
        except Exception as error:  # e.g. no C++ compiler for inductor: the same would fail at every start
            (graph_dir(args.spec.key) / FAILED).write_text(f"{type(error).__name__}: {error}")
            raise


if __name__ == "__main__":
    sys.exit(main())
