"""Running the server in this process: what `furcate serve` calls."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import Any

from aiohttp import web

from ..config import EngineArgs, ServerArgs
from .server_process import READY_PREFIX, url_host


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, then finish (or abort) in-flight requests and exit 0.
    With dp_size > 1 or pd_disaggregation: servers behind sglang-router (data_parallel.py)."""
    from ..engine.engine import Engine

    if server_args.dp_size > 1 or server_args.pd_disaggregation:
        from .data_parallel import serve_data_parallel

        return serve_data_parallel(engine_args, server_args)
    engine = Engine(**dataclasses.asdict(engine_args))
    try:
        asyncio.run(_serve(engine, server_args))
    finally:
        engine.shutdown()
    return 0


async def _serve(engine: Any, settings: ServerArgs) -> None:
    from .app import create_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(create_app(engine, settings), handler_cancellation=True, access_log=None,
                           shutdown_timeout=settings.graceful_shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"{READY_PREFIX}http://{url_host(host)}:{port}", flush=True)
    await stop.wait()
    print("furcate server shutting down", flush=True)
    await runner.cleanup()  # stops listening, lets in-flight handlers finish up to shutdown_timeout, cancels the rest
