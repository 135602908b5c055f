"""Server-sent events: `data: {json}` lines ending with `data: [DONE]`, as SGLang and OpenAI stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


async def send_error(response: web.StreamResponse, error: Exception) -> None:
    """A failure after the stream opened, as an event: code 400 for a bad request (ValueError), else 500."""
    status = 400 if isinstance(error, ValueError) else 500
    await send_event(response, {"error": {"message": str(error), "code": status}})


async def stop_pumps(pumps: list[asyncio.Future]) -> None:
    """Cancel the tasks feeding a merged stream and wait until they are gone (a client that went away)."""
    for pump in pumps:
        pump.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
