"""furcate: structured LLM programs on a runtime whose KV cache is shared across program branches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "EngineArgs"]

if TYPE_CHECKING:
    from .runtime.config import EngineArgs
    from .runtime.engine import Engine


def __getattr__(name: str) -> Any:
    # The runtime pulls in torch; import it only when a user reaches for it.
    if name == "Engine":
        from .runtime.engine import Engine

        return Engine
    if name == "EngineArgs":
        from .runtime.config import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'furcate' has no attribute {name!r}")
