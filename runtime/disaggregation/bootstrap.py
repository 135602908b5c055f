"""The bootstrap service that pairs prefill and decode servers by bootstrap_room.

The prefill server's scheduler runs it on --disaggregation-bootstrap-port. A decode server that got a request
claims the request's room with one HTTP call carrying where the K/V must go (its transfer session, KV layout
and the slots it reserved) and waits on that call for the outcome: the first token, or an error. Either side
may arrive first. The decode server's slots must never be written after it freed them, so the decision to give
up is taken here, under one lock, against the decision to write: a claim is either withdrawn or written, never
both.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# Beyond its own deadline, how long a decode server waits for a bootstrap service that stopped answering
# before it assumes no write can still arrive.
CLIENT_GRACE_S = 30.0
# The longest a claim may ask to wait (a day): bounds what one call can hold.
MAX_CLAIM_TIMEOUT_S = 86400.0


@dataclass
class Claim:
    destination: dict[str, Any]
    outcome: Future = field(default_factory=Future)  # what the decode server's call returns
    writing: bool = False
    withdrawn: bool = False


class RoomRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[int, Claim] = {}
        self._expected: dict[int, Callable[[Claim], None]] = {}

    def claim(self, room: int, destination: dict[str, Any]) -> Claim | None:
        """A decode server's claim; None when the room is claimed already."""
        with self._lock:
            if room in self._claims:
                return None
            claim = self._claims[room] = Claim(destination)
            on_claim = self._expected.pop(room, None)
        if on_claim is not None:
            on_claim(claim)
        return claim

    def expect(self, room: int, on_claim: Callable[[Claim], None]) -> None:
        """The prefill side has the K/V of `room`; call on_claim once it is (or now if it was) claimed."""
        with self._lock:
            claim = self._claims.get(room)
            if claim is None:
                self._expected[room] = on_claim
                return
        on_claim(claim)

    def forget(self, room: int) -> bool:
        """The prefill side gives up waiting for a claim; False when a claim arrived meanwhile (it proceeds)."""
        with self._lock:
            return self._expected.pop(room, None) is not None

    def begin_write(self, claim: Claim) -> bool:
        with self._lock:
            if claim.withdrawn:
                return False
            claim.writing = True
            return True

    def withdraw(self, room: int, claim: Claim) -> bool:
        """The decode side gives up; False when writing has begun (the caller then waits for its outcome)."""
        with self._lock:
            if claim.writing:
                return False
            claim.withdrawn = True
            self._claims.pop(room, None)
            return True

    def settle(self, room: int, claim: Claim, outcome: dict[str, Any]) -> None:
        with self._lock:
            self._claims.pop(room, None)
        if not claim.outcome.done():
            claim.outcome.set_result(outcome)


class LoopThread:
    """An asyncio loop on a daemon thread: the bootstrap server (prefill side) and the claims (decode side)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def submit(self, coroutine: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


class BootstrapServer:
    def __init__(self, registry: RoomRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.loop = LoopThread("furcate-bootstrap")
        app = web.Application()
        app.router.add_post("/rooms/{room}", self._claim)
        app.router.add_get("/health", self._health)
        self.loop.submit(self._start(app, host, port)).result(timeout=30)

    async def _start(self, app: web.Application, host: str, port: int) -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as error:
            raise RuntimeError(f"the bootstrap service cannot listen on {host}:{port}: {error}; choose another "
                               f"--disaggregation-bootstrap-port") from None

    @staticmethod
    async def _health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _claim(self, request: web.Request) -> web.Response:
        try:
            room = int(request.match_info["room"])
            destination = await request.json()
            timeout = float(destination["timeout"])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            return web.json_response({"error": "a claim needs a JSON object body with a timeout"}, status=400)
        if not 0 < timeout <= MAX_CLAIM_TIMEOUT_S:  # also refuses NaN
            return web.json_response({"error": f"timeout must be in (0, {MAX_CLAIM_TIMEOUT_S:g}] seconds"}, status=400)
        claim = self.registry.claim(room, destination)
        if claim is None:
            return web.json_response({"error": f"bootstrap_room {room} is claimed already"}, status=409)
        outcome = asyncio.wrap_future(claim.outcome)
        try:
            return web.json_response(await asyncio.wait_for(asyncio.shield(outcome), timeout))
        except (TimeoutError, asyncio.CancelledError) as stopped:
            if self.registry.withdraw(room, claim):
                if isinstance(stopped, asyncio.CancelledError):
                    raise  # the decode server hung up; nothing was or will be written
                return web.json_response({"error": f"the prefill server did not send bootstrap_room {room}'s KV "
                                                   f"within {timeout:g} s"}, status=504)
            return web.json_response(await outcome)  # writing has begun: it ends soon either way


async def claim_room(session: aiohttp.ClientSession, host: str, port: int, room: int,
                     destination: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Decode side: claim a room and wait for its outcome; {"error": ...} when it failed or nobody answered."""
    url = f"http://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{port}/rooms/{room}"
    try:
        async with session.post(url, json={**destination, "timeout": timeout},
                                timeout=aiohttp.ClientTimeout(total=timeout + CLIENT_GRACE_S)) as response:
            body = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as error:
        return {"error": f"the prefill server's bootstrap service at {host}:{port} did not answer: "
                         f"{type(error).__name__}: {error}"}
    if not isinstance(body, dict) or ("error" not in body and "first_token" not in body):
        return {"error": f"the bootstrap service at {host}:{port} sent an unexpected answer: {body!r}"[:300]}
    return body
