"""Runs programs: states, the executor, fork/join, run/run_batch (sync and async), streaming, backends."""

from .backends.base import Backend
from .backends.resolve import flush_cache, get_server_info, set_default_backend
from .errors import ProgramError
from .function import Function, function
from .state import ProgramState, ProgramStateGroup

__all__ = ["Backend", "Function", "ProgramError", "ProgramState", "ProgramStateGroup", "flush_cache", "function",
           "get_server_info", "set_default_backend"]
