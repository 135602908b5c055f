"""The RL control calls' arguments, engine -> scheduler (RpcReq.payload): SGLang's names, checked on both sides.

The engine checks types and ranges (a bad call fails in the caller, ValueError -> HTTP 400); the scheduler checks
what only it knows (tensor names and shapes against the served model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
GROUP_BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP = "weight_update_group"
DEFAULT_GROUP_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 24 * 3600.0
MAX_TEXT = 4096


@dataclass(frozen=True)
class UpdateFromTensor:
    path: str  # the named tensors as a safetensors file the engine wrote (in shared memory where there is one)
    flush_cache: bool = True
    weight_version: str | None = None


@dataclass(frozen=True)
class UpdateFromDisk:
    model_path: str
    weight_version: str | None = None


@dataclass(frozen=True)
class InitGroup:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "gloo"
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S


@dataclass(frozen=True)
class UpdateFromDistributed:
    names: list[str]
    dtypes: list[Any]
    shapes: list[Any]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    weight_version: str | None = None


@dataclass(frozen=True)
class GetWeights:
    name: str
    truncate_size: int = 100


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_text(name: str, value: Any, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise ValueError(f"{name} must be a non-empty string of at most {MAX_TEXT} characters, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid text (a lone surrogate?)") from None
    return value


def check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def check_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:.0f}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def memory_tags(tags: Any) -> tuple[str, ...]:
    """SGLang's tags: None means all of them."""
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, (list, tuple)) or not tags or len(tags) > len(MEMORY_TAGS):
        raise ValueError(f"tags must be null or a non-empty list of {list(MEMORY_TAGS)}, got {tags!r}")
    return tuple(dict.fromkeys(check_choice("a tag", tag, MEMORY_TAGS) for tag in tags))


def init_group(master_address: Any, master_port: Any, rank_offset: Any, world_size: Any, group_name: Any,
               backend: Any, timeout: Any) -> InitGroup:
    world = check_int("world_size", world_size, 2, 65536)
    return InitGroup(check_text("master_address", master_address), check_int("master_port", master_port, 1, 65535),
                     check_int("rank_offset", rank_offset, 1, world - 1), world, check_text("group_name", group_name),
                     check_choice("backend", backend, GROUP_BACKENDS), check_timeout(timeout))
