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
    separate_reasoning,
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
    "init_weight_group", "serialize_named_tensors",
    "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]

if TYPE_CHECKING:
    from .interpreter.backends.endpoint import RuntimeEndpoint
    from .interpreter.backends.local import LocalBackend
    from .interpreter.backends.openai_backend import OpenAI
    from .interpreter.backends.runtime_server import Runtime
    from .runtime.config import EngineArgs
    from .runtime.distributed.weight_group import init_weight_group
    from .runtime.engine import Engine
    from .runtime.engine.rl import serialize_named_tensors


# The runtime pulls in torch, the remote backends aiohttp / openai: imported when a user first reaches for them.
LAZY = {
    "Engine": "runtime.engine", "EngineArgs": "runtime.config", "LocalBackend": "interpreter.backends.local",
    "RuntimeEndpoint": "interpreter.backends.endpoint", "Runtime": "interpreter.backends.runtime_server",
    "OpenAI": "interpreter.backends.openai_backend",
    # RL trainers: the HTTP form of update_weights_from_tensor, and the weight group SGLang's trainers join.
    "serialize_named_tensors": "runtime.engine.rl", "init_weight_group": "runtime.distributed.weight_group",
}


def __getattr__(name: str) -> Any:
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(f".{LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'furcate' has no attribute {name!r}")
