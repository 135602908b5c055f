"""Which attention backend runs: the registered backends, and what "auto" and a GPU-only name mean on a device.

Only backends that exist in this build are registered: triton where the triton package is installed (CUDA torch
and xgrammar bring it), flashinfer when its package is. flashinfer and triton are known names, so choosing one
where it cannot run (no CUDA, not installed) is an error that says which, not an "unknown choice".
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from .. import registry

if TYPE_CHECKING:  # torch stays unimported for config validation on CPU
    from .base import ModelAttention

KIND = "attention_backend"
AUTO = "auto"
# Backends that run only on CUDA, in the order "auto" prefers them there.
CUDA_ONLY = ("flashinfer", "triton")

registry.register(KIND, AUTO)
registry.register(KIND, "torch_native", f"{__package__}.torch_native:TorchNativeAttention")
if importlib.util.find_spec("triton") is not None:
    registry.register(KIND, "triton", f"{__package__}.triton_backend:TritonAttention")


def cuda_available() -> bool:
    import torch  # only asked for a CUDA device: keeps config validation on CPU free of the torch import

    return torch.cuda.is_available()


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_device(device: str) -> str:
    """"auto": CUDA when torch sees a CUDA device, else the CPU; any other name as given."""
    if device != AUTO:
        return device
    return "cuda" if cuda_available() else "cpu"


# Registered by import path: the module (and flashinfer with it) is imported only when the backend is chosen.
if flashinfer_importable():
    registry.register(KIND, "flashinfer", f"{__package__}.flashinfer_backend:FlashInferAttention")


def on_cuda(device: str) -> bool:
    return resolve_device(device).startswith("cuda") and cuda_available()


def resolve_attention_backend(name: str, device: str) -> str:
    """The concrete backend `name` means on `device`; ValueError saying why when it cannot run there."""
    device = resolve_device(device) if name != "torch_native" else device
    if name == AUTO:
        return _auto(device)
    if name in CUDA_ONLY:
        _check_cuda_only(name, device)
    registry.check(KIND, name)
    return name


def make_attention_backend(name: str, device: str, model: ModelAttention | None = None):
    """A backend flagged `needs_model` plans batches before any layer runs, so it is built with the model's
    attention shape; one flagged `uses_model` is given it when known (torch_native picks its decode kernel by
    it); the others learn what they need from each layer's call."""
    backend = registry.resolve(KIND, soft_cap_capable(name, resolve_attention_backend(name, device), model))
    if getattr(backend, "needs_model", False):
        if model is None:
            raise ValueError(f"attention_backend {name!r} plans ahead and needs the model's attention shape")
        return backend(model)
    return backend(model) if getattr(backend, "uses_model", False) else backend()


def soft_cap_capable(asked: str, resolved: str, model: ModelAttention | None) -> str:
    """Triton's kernels have no soft-capping of attention scores: auto falls back on torch_native for a model
    whose layers cap them (Gemma 2), and asking for triton by name is refused."""
    if resolved != "triton" or model is None or model.logit_cap is None:
        return resolved
    if asked == AUTO:
        return "torch_native"
    raise ValueError("attention_backend 'triton' cannot soft-cap attention scores, which this model's layers do; "
                     "use 'flashinfer' or 'torch_native'")


def _auto(device: str) -> str:
    if not on_cuda(device):
        return "torch_native"
    # Without the flashinfer package, triton (shipped with CUDA torch) is the next fastest.
    preferred = CUDA_ONLY if flashinfer_importable() else CUDA_ONLY[1:]
    return next((name for name in preferred if registry.is_registered(KIND, name)), "torch_native")


def _check_cuda_only(name: str, device: str) -> None:
    if not device.startswith("cuda"):
        raise ValueError(f"attention_backend {name!r} runs only on CUDA, and device is {device!r}; "
                         f"use 'auto' or 'torch_native'")
    if not cuda_available():
        raise ValueError(f"attention_backend {name!r} needs CUDA, and torch sees no CUDA device")
    if name == "flashinfer" and not flashinfer_importable():
        raise ValueError("attention_backend 'flashinfer' needs the flashinfer package, which is not installed; "
                         "use 'auto' (triton or torch_native then)")
    if not registry.is_registered(KIND, name):
        raise ValueError(f"attention_backend {name!r} is not available in this build; "
                         f"available: {registry.names(KIND)}")
