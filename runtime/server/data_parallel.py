"""`furcate serve --dp-size N`: N furcate servers on free loopback ports behind one sglang-router, which
listens where a single server would. The router does the routing (cache-aware by default: it keeps its own
approximate radix tree of request text per worker, so requests sharing a prefix go where it is cached).
With --pd-disaggregation: N prefill servers (each with its own bootstrap port) and N decode servers behind the
router in PD mode, which sends every request to one of each.
Everything starts from one command and stops together on SIGINT/SIGTERM, or when any part dies.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import signal
import socket
import subprocess
import sys
import threading
import time

import requests

from ..config import EngineArgs, ServerArgs
from .server_process import READY_PREFIX, ServerProcess, url_host

ROUTER_STARTUP_S = 60.0


def serve_data_parallel(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    if importlib.util.find_spec("sglang_router") is None:
        raise RuntimeError("--dp-size and --pd-disaggregation need sglang-router: pip install 'furcate[scale]' "
                           "(sglang-router==0.3.2)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workers: list[ServerProcess] = []
    router: subprocess.Popen | None = None
    try:
        if server_args.pd_disaggregation:
            worker_args = _start_pd_workers(engine_args, server_args, workers)
        else:
            for _ in range(server_args.dp_size):
                workers.append(_start_worker(engine_args, server_args, server_args.dp_size))
            worker_args = ["--worker-urls", *(w.url for w in workers)]
        port = server_args.port or _free_port(server_args.host)
        url = f"http://{url_host(server_args.host)}:{port}"
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", server_args.host, "--port",
                   str(port), "--policy", server_args.router_policy, *worker_args, "--log-level", "warn",
                   # Its Prometheus exporter binds 29000 unless told otherwise; two routers must not collide.
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port("127.0.0.1"))]
        router = subprocess.Popen(command)
        wait_router_ready(url, router, len(workers))
        print(f"{READY_PREFIX}{url}", flush=True)
        while not stop.wait(0.5):
            if router.poll() is not None or any(w.process.poll() is not None for w in workers):
                print("furcate: a data-parallel worker or the router exited; stopping all", flush=True)
                return 1
        print("furcate server shutting down", flush=True)
        return 0
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            router.wait(timeout=30)
        for worker in workers:
            worker.stop()


def _start_pd_workers(engine_args: EngineArgs, server_args: ServerArgs, workers: list[ServerProcess]) -> list[str]:
    """dp_size prefill and dp_size decode servers (appended to `workers` as they start); the router's arguments."""
    router_args = ["--pd-disaggregation"]
    for _ in range(server_args.dp_size):
        bootstrap = _free_port("127.0.0.1")
        prefill = dataclasses.replace(engine_args, disaggregation_mode="prefill",
                                      disaggregation_bootstrap_port=bootstrap)
        workers.append(_start_worker(prefill, server_args, 2 * server_args.dp_size))
        router_args += ["--prefill", workers[-1].url, str(bootstrap)]
    for _ in range(server_args.dp_size):
        decode = dataclasses.replace(engine_args, disaggregation_mode="decode")
        workers.append(_start_worker(decode, server_args, 2 * server_args.dp_size))
        router_args += ["--decode", workers[-1].url]
    return router_args


def _start_worker(engine_args: EngineArgs, server_args: ServerArgs, num_workers: int) -> ServerProcess:
    """One server on a free loopback port; the cores are shared out between the servers unless set."""
    args = {k: v for k, v in dataclasses.asdict(engine_args).items() if k != "model_path"}
    args["torch_num_threads"] = engine_args.torch_num_threads or max(1, engine_args.num_threads // num_workers)
    extra = ["--graceful-shutdown-timeout", str(server_args.graceful_shutdown_timeout)]
    if server_args.served_model_name:
        extra += ["--served-model-name", server_args.served_model_name]
    return ServerProcess(engine_args.model_path, args, host="127.0.0.1", port=0, extra_args=tuple(extra))


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_router_ready(url: str, router: subprocess.Popen, num_workers: int) -> None:
    """Until the router lists every worker as healthy. Its /health answers 200 before it has registered them
    (it adds them in the background), and until then it answers requests with 503 "No workers are available"."""
    deadline = time.monotonic() + ROUTER_STARTUP_S
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"sglang-router exited with code {router.returncode} during start-up")
        try:
            listed = requests.get(f"{url}/workers", timeout=2).json()["workers"]
            if sum(bool(w.get("is_healthy")) for w in listed) == num_workers:
                return
        except (requests.ConnectionError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"sglang-router did not list its {num_workers} workers as healthy within "
                       f"{ROUTER_STARTUP_S:.0f}s")
