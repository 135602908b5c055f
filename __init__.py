"""furcate: structured LLM programs on a runtime whose KV cache is shared across program branches.

`import furcate as sgl` runs programs written for SGLang's frontend. Importing the language does not load torch;
the runtime (Engine) loads it when first reached for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .interpreter import (
    Backend, Function, ProgramError, ProgramState, ProgramStateGroup, flush_cache, function, get_server_info,
    set_default_backend,
)
from .lang import (
    assistant, assistant_begin, assistant_end, gen, gen_int, gen_string, greedy_token_selection, image, select,
    system, system_begin, system_end, token_length_normalized, unconditional_likelihood_normalized, user,
    user_begin, user_end, video,
)

__version__ = "0.1.0"
__all__ = [
    "Backend", "Engine", "EngineArgs", "Function", "LocalBackend", "ProgramError", "ProgramState",
    "ProgramStateGroup", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_server_info", "greedy_token_selection", "image", "select", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end", "video",
]

if TYPE_CHECKING:
    from .interpreter.backends.local import LocalBackend
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
    if name == "LocalBackend":
        from .interpreter.backends.local import LocalBackend

        return LocalBackend
    raise AttributeError(f"module 'furcate' has no attribute {name!r}")
