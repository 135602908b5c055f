"""Turn what a user passes as a backend (an Engine, a backend, SGLang-style wrappers) into a Backend."""

from __future__ import annotations

import weakref
from typing import Any

from .base import Backend

_default: Backend | None = None
_wrapped: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()


def as_backend(obj: Any) -> Backend:
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)  # SGLang's Runtime exposes its endpoint this way
    if endpoint is not None and endpoint is not obj:
        return as_backend(endpoint)
    if hasattr(obj, "async_generate") and hasattr(obj, "tokenizer"):  # an Engine (duck-typed: no torch import)
        if obj not in _wrapped:
            from .local import LocalBackend

            _wrapped[obj] = LocalBackend(obj)
        return _wrapped[obj]
    raise TypeError(f"not a backend: {obj!r}; pass a furcate.Engine or a backend such as LocalBackend")


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when run() is given none: an Engine or any backend."""
    global _default
    _default = None if backend is None else as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default


def resolve_backend(backend: Any = None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default is None:
        raise RuntimeError("no backend: call furcate.set_default_backend(furcate.Engine(...)) or pass backend=")
    return _default


def flush_cache(backend: Any = None) -> bool:
    """Drop the backend's prefix cache (False while requests are in flight)."""
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()
