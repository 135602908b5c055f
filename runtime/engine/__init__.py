"""The caller's process: the Engine, its RL calls, request building, per-request state, detokenizing and schema
checks, and the launch of the scheduler process. Nothing here imports the scheduler, the executor, the kernels or
the model's architecture: the model runs in the scheduler process only."""

from .engine import Engine

__all__ = ["Engine"]
