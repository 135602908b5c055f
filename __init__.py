"""furcate: structured LLM programs on a runtime whose KV cache is shared across program branches.

`import furcate as sgl` runs programs written for SGLang's frontend. Importing the language does not load torch;
the runtime (Engine) loads it when first reached for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .interpreter import (
    Backend,
    Function,
    ProgramError,
    ProgramState,
    ProgramStateGroup,
    flush_cache,
    function,
    get_server_info,
    set_default_backend,
)
from .lang import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    image,
    select,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from .version import __version__ as __version__  # the public `furcate.__version__`

__all__ = [
    "Backend", "Engine", "EngineArgs", "Function", "LocalBackend", "OpenAI", "ProgramError", "ProgramState",
    "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info", "greedy_token_selection", "image",
    "select", "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]

if TYPE_CHECKING:
    from .interpreter.backends.endpoint import RuntimeEndpoint
    from .interpreter.backends.local import LocalBackend
    from .interpreter.backends.openai_backend import OpenAI
    from .interpreter.backends.runtime_server import Runtime
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
    # The remote backends pull in aiohttp / openai: also imported on first use only.
    if name == "RuntimeEndpoint":
        from .interpreter.backends.endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    if name == "Runtime":
        from .interpreter.backends.runtime_server import Runtime

        return Runtime
    if name == "OpenAI":
        from .interpreter.backends.openai_backend import OpenAI

        return OpenAI
    raise AttributeError(f"module 'furcate' has no attribute {name!r}")
