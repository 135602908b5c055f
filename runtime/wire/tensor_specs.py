"""What a weight update says of each tensor before its data arrives (names, dtypes, shapes), checked in the caller's
process and again where the update is planned (model/weights/weight_update.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

UPDATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_TENSORS = 100_000  # more names than any checkpoint has: a list this long is a mistake, not a model
MAX_DIMS = 8


@dataclass(frozen=True)
class TensorSpec:
    """What an update says of one tensor before its data arrives."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parse_dtype(value: Any) -> torch.dtype:
    """A dtype as trainers send it: "bfloat16", "torch.bfloat16", or a torch.dtype."""
    if isinstance(value, torch.dtype) and value in UPDATE_DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in UPDATE_DTYPES:
        return UPDATE_DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"dtype must be one of {sorted(UPDATE_DTYPES)}, got {value!r}")


def parse_shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_DIMS:
        raise ValueError(f"a shape must be a list of 1 to {MAX_DIMS} sizes, got {value!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value):
        raise ValueError(f"a shape's sizes must be positive integers, got {value!r}")
    return tuple(value)


def tensor_specs(names: Any, dtypes: Any, shapes: Any) -> list[TensorSpec]:
    """SGLang's parallel lists (update_weights_from_distributed) as specs, or ValueError saying what is wrong."""
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_TENSORS:
            raise ValueError(f"{field} must be a list of 1 to {MAX_TENSORS} entries, got {type(value).__name__}")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    return [TensorSpec(check_name(n), parse_dtype(d), parse_shape(s)) for n, d, s in zip(names, dtypes, shapes)]


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= 512:
        raise ValueError(f"a tensor name must be a string of 1 to 512 characters, got {name!r}")
    return name


def spec_of(name: Any, tensor: Any) -> TensorSpec:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"tensor {name!r} is a scalar; weights have at least one dimension")
    return TensorSpec(check_name(name), parse_dtype(tensor.dtype), tuple(tensor.shape))
