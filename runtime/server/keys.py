"""What the app holds for its routes (typed aiohttp app keys)."""

from __future__ import annotations

from aiohttp import web

from ..config import ServerArgs
from ..engine.engine import Engine
from .metrics import ServerMetrics

ENGINE = web.AppKey("engine", Engine)
SETTINGS = web.AppKey("settings", ServerArgs)
METRICS = web.AppKey("metrics", ServerMetrics)
