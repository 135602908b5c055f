"""SGLang's RL routes: weight updates, the trainer's group, memory release and resume, pause and continue.

Bodies and replies as SGLang's: {"success": bool, "message": str}, HTTP 200 or 400 (a refused call, or a field
that is missing, of the wrong type or out of range). The API key guards them like every other route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..engine.engine import Engine
from ..wire.weight_messages import DEFAULT_GROUP, DEFAULT_GROUP_TIMEOUT_S
from .errors import ApiError, check_fields, read_json_object
from .keys import ENGINE

Call = Callable[[Engine, dict[str, Any]], Any]


def add_routes(app: web.Application) -> None:
    for path, call, fields in ROUTES:
        app.router.add_post(path, route(call, fields))
    app.router.add_get("/get_weight_version", route(weight_version, frozenset()))


def route(call: Call, fields: frozenset[str]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        body = await read_json_object(request) if request.can_read_body else {}
        check_fields(body, fields)
        try:
            result = await asyncio.to_thread(call, request.app[ENGINE], body)
        except ValueError as error:
            return web.json_response({"success": False, "message": str(error)}, status=400)
        except ApiError as error:
            return web.json_response({"success": False, "message": error.message}, status=error.status)
        return reply(result)

    return handle


def reply(result: Any) -> web.Response:
    if isinstance(result, tuple):
        success, message = result
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)
    return web.json_response(result)


def required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise ApiError(400, f"missing field {name!r}")
    return body[name]


def weight_version(engine: Engine, body: dict[str, Any]) -> dict[str, str]:
    return {"weight_version": engine.get_weight_version()}


UPDATE_COMMON = frozenset({"flush_cache", "weight_version", "load_format"})
ROUTES: list[tuple[str, Call, frozenset[str]]] = [
    ("/init_weights_update_group", lambda e, b: e.init_weights_update_group(
        required(b, "master_address"), required(b, "master_port"), required(b, "rank_offset"),
        required(b, "world_size"), b.get("group_name", DEFAULT_GROUP), b.get("backend", "gloo"),
        b.get("timeout", DEFAULT_GROUP_TIMEOUT_S)),
     frozenset({"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout"})),
    ("/destroy_weights_update_group", lambda e, b: e.destroy_weights_update_group(b.get("group_name", DEFAULT_GROUP)),
     frozenset({"group_name"})),
    ("/update_weights_from_distributed", lambda e, b: e.update_weights_from_distributed(
        required(b, "names"), required(b, "dtypes"), required(b, "shapes"), b.get("group_name", DEFAULT_GROUP),
        b.get("flush_cache", True), b.get("weight_version"), b.get("load_format")),
     frozenset({"names", "dtypes", "shapes", "group_name"}) | UPDATE_COMMON),
    ("/update_weights_from_tensor", lambda e, b: e.update_serialized_weights(
        required(b, "serialized_named_tensors"), b.get("load_format"), b.get("flush_cache", True),
        b.get("weight_version")),
     frozenset({"serialized_named_tensors"}) | UPDATE_COMMON),
    ("/update_weights_from_disk", lambda e, b: e.update_weights_from_disk(
        required(b, "model_path"), b.get("load_format"), b.get("weight_version")),
     frozenset({"model_path", "load_format", "weight_version"})),
    ("/get_weights_by_name", lambda e, b: e.get_weights_by_name(required(b, "name"), b.get("truncate_size", 100)),
     frozenset({"name", "truncate_size"})),
    ("/get_weight_version", weight_version, frozenset()),
    ("/release_memory_occupation", lambda e, b: e.release_memory_occupation(b.get("tags")), frozenset({"tags"})),
    ("/resume_memory_occupation", lambda e, b: e.resume_memory_occupation(b.get("tags")), frozenset({"tags"})),
    ("/pause_generation", lambda e, b: e.pause_generation(b.get("mode", "abort")), frozenset({"mode"})),
    ("/continue_generation", lambda e, b: e.continue_generation(), frozenset()),
]
