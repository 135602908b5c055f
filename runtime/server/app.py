"""The aiohttp application: middlewares (errors as JSON, API key), the routes, the engine's lifetime hooks."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..config import ServerArgs
from ..engine.engine import Engine, QueueFullError
from ..wire.messages import PeerServerError
from . import native, openai_api, rl_routes
from .errors import ApiError, error_response
from .keys import ENGINE, METRICS, SETTINGS
from .metrics import ServerMetrics

logger = logging.getLogger("furcate.server")

# Routes a load balancer probes without credentials.
OPEN_ROUTES = frozenset({"/health", "/health_generate"})
RETRY_AFTER_S = 1  # a full queue drains as requests finish: decode steps take milliseconds, a prefill seconds

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(engine: Engine, settings: ServerArgs) -> web.Application:
    app = web.Application(client_max_size=settings.max_request_bytes,
                          middlewares=[errors_as_json, api_key_check(settings.api_key)])
    app[ENGINE] = engine
    app[SETTINGS] = settings
    app[METRICS] = ServerMetrics(engine)
    native.add_routes(app)
    openai_api.add_routes(app)
    rl_routes.add_routes(app)
    return app


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON error for this request alone; nothing escapes to the server."""
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error.status, error.message, error.error_type)
    except QueueFullError as error:  # the engine is full now, not broken: clients and routers retry after a pause
        response = error_response(503, str(error))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    except ValueError as error:  # the engine's validation: the request is wrong, not the server
        return error_response(400, str(error))
    except TimeoutError as error:
        return error_response(504, str(error) or "the request timed out")
    except PeerServerError as error:
        return error_response(502, str(error))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = error.text if error.text and error.status != 413 else error.reason
        if error.status == 413:
            message = f"request body too large: the limit is {request.app[SETTINGS].max_request_bytes} bytes"
        return error_response(error.status, message)
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nobody to answer
    except Exception as error:  # a bug in one request must not take the server down
        logger.exception("request %s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(error).__name__}: {error}")


def api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):  # constant time: the key cannot be guessed bytewise
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        return await handler(request)

    return check
