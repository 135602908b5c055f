"""furcate::packed_linear, the op a compiled graph calls for a oneDNN-packed linear (model/packed_linear.py), with
its CPU kernel in C++ (csrc/packed_linear_op.cpp) where that builds.

Registered at the low level, a CPU kernel and nothing else: torch.library.custom_op's wrappers cost microseconds a
call. Where the C++ does not build, the caller's Python kernel is registered instead.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from collections.abc import Callable

import torch

from . import native_build

logger = logging.getLogger("furcate.packed_linear")

_LIBRARY = torch.library.Library("furcate", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
OP_SOURCE = pathlib.Path(__file__).parent / "csrc" / "packed_linear_op.cpp"


@functools.cache
def native_kernel(python_kernel: Callable[..., torch.Tensor]) -> bool:
    """Whether furcate::packed_linear runs packed_linear_op.cpp's kernel (built once per machine with the C++
    compiler and torch's headers); otherwise, or with FURCATE_NATIVE_OPS=0, python_kernel is registered."""
    return native_build.register_op_kernel(_LIBRARY, "packed_linear", OP_SOURCE, python_kernel, logger)


@torch.library.register_fake("furcate::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


packed_linear_op = torch.ops.furcate.packed_linear.default
