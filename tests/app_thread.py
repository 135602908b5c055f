"""The server's aiohttp app over an engine this test process runs, on a loopback port: what `furcate serve` runs,
without a second interpreter to start (tests whose server must be the real command use ServerProcess)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from furcate.runtime.config import ServerArgs
from furcate.runtime.server.app import create_app


class AppOnThread:
    """The app on its own event loop thread; `.url` once it listens."""

    def __init__(self, engine) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="furcate-test-app")
        self.thread.start()
        self.runner = web.AppRunner(create_app(engine, ServerArgs(port=0)), handler_cancellation=True)
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)
