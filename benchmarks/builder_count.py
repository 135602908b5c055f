"""Graph builder processes left alive by a script that starts and shuts down engines one after another on a cold
graph cache (a test suite, a notebook, a sweep over configs): they used to pile up and outlive their engines.

The engines take turns between two configs (torch_compile_max_bs 32 and 1: two graph keys). Each decodes a few
tokens and shuts down; the script counts the builder processes working for its private cache folder (found by
their command line and environment) right after each shutdown and after a settle time, and samples the count
every 0.2 s throughout for the peak. At the end it kills the builders still alive, by pid, and removes the
folder, so that the run leaves nothing behind. The cache folder is a fresh temporary one: cold graphs and kernel
choices, with the converted models and built kernels linked from the user's cache (what the run does not
measure).

    python -m benchmarks.builder_count [--engines 10] [--settle 5] [--model default] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time

BUILDER_MODULE = "furcate.runtime.executor.graph_builder"
CONFIGS = ({"torch_compile_max_bs": 32}, {"torch_compile_max_bs": 1})
SAMPLE_S = 0.2


def builders(cache: str) -> list[int]:
    """The pids of live graph builders whose FURCATE_CACHE is `cache`."""
    found = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if BUILDER_MODULE.encode() in (proc / "cmdline").read_bytes() and \
                    f"FURCATE_CACHE={cache}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def cold_cache() -> str:
    """A new cache folder sharing only the converted models and the built kernels with the user's."""
    folder = tempfile.mkdtemp(prefix="furcate-builders-")
    user = pathlib.Path(os.environ.get("FURCATE_CACHE") or "~/.cache/furcate").expanduser()
    for shared in ("models", "kernels"):
        if (user / shared).is_dir():
            (pathlib.Path(folder) / shared).symlink_to(user / shared, target_is_directory=True)
    return folder


class PeakSampler:
    """The most builders alive at once, sampled on a thread."""

    def __init__(self, cache: str) -> None:
        self.cache, self.peak, self.done = cache, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.peak = max(self.peak, len(builders(self.cache)))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def one_engine(model: str, config: dict) -> None:
    from furcate import Engine

    with Engine(model, max_total_tokens=2048, **config) as engine:
        engine.generate("The harbour at dawn", {"max_new_tokens": 8, "temperature": 0})


def run(engines: int, settle: float, model: str, cache: str) -> dict:
    sampler, rows = PeakSampler(cache), []
    for i in range(engines):
        started = time.monotonic()
        one_engine(model, CONFIGS[i % len(CONFIGS)])
        after_shutdown = len(builders(cache))
        time.sleep(settle)
        rows.append({"engine": i + 1, "seconds": round(time.monotonic() - started - settle, 1),
                     "after_shutdown": after_shutdown, "after_settle": len(builders(cache))})
        print(json.dumps(rows[-1]), flush=True)
    left = builders(cache)
    return {"engines": engines, "settle_s": settle, "peak_alive": sampler.stop(), "left_at_end": len(left),
            "rows": rows, "load_1min": os.getloadavg()[0], "cpus": os.cpu_count()}


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=10)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait after each shutdown")
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", help="also write the results here (JSON)")
    args = parser.parse_args()
    if args.engines < 1 or args.settle < 0:
        parser.error("--engines must be >= 1 and --settle >= 0")
    cache = cold_cache()
    os.environ.update(FURCATE_CACHE=cache, FURCATE_AUTO_COMPILE="1")
    try:
        results = run(args.engines, args.settle, args.model, cache)
    finally:
        kill(builders(cache))
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({k: v for k, v in results.items() if k != "rows"}))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
