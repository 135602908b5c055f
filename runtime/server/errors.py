"""Errors a route answers with: JSON `{"error": {"message", "type", "code"}}` (the OpenAI shape, used everywhere)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class ApiError(Exception):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or error_type_for(status)


def error_type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable"
    return "invalid_request_error" if status < 500 else "internal_server_error"


def error_body(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type or error_type_for(status), "code": status}}


def error_response(status: int, message: str, error_type: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, error_type), status=status)


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or ApiError 400 naming what is wrong with it."""
    raw = await request.read()  # raises 413 itself past the app's client_max_size
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")  # explicitly: json.loads(bytes) would guess UTF-16/32 from the first bytes
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not UTF-8: {error.reason} at byte {error.start}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"malformed JSON: {error.msg} (line {error.lineno}, column {error.colno})") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_fields(body: dict[str, Any], known: frozenset[str], where: str = "request") -> None:
    unknown = sorted(str(key) for key in body if key not in known)
    if unknown:
        raise ApiError(400, f"unknown {where} field(s): {', '.join(unknown)}")
