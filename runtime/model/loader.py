"""Load a model directory (config.json + safetensors shards) into our decoder implementation."""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from transformers import AutoConfig

from .decoder import FAMILIES, DecoderForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model_path: str | None) -> str:
    """"default" (or nothing) means the embedded SmolLM2 model, converted from its GGUF on first use."""
    if model_path in (None, "", "default"):
        from .default_model import prepare_default_model

        return str(prepare_default_model())
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path {model_path!r} is not a directory (furcate never downloads models)")
    return model_path


def load_config(model_path: str):
    config = AutoConfig.from_pretrained(model_path)
    architecture = architecture_of(config)
    if architecture is None:
        raise ValueError(f"unsupported architecture {config.architectures or config.model_type!r}; "
                         f"furcate runs {sorted(FAMILIES)}")
    return config


def architecture_of(config) -> str | None:
    """The supported architecture a config names; configs without `architectures` fall back on model_type."""
    for name in getattr(config, "architectures", None) or []:
        if name in FAMILIES:
            return name
    by_model_type = {name.removesuffix("ForCausalLM").lower(): name for name in FAMILIES}
    return by_model_type.get(config.model_type) if not getattr(config, "architectures", None) else None


def resolve_dtype(dtype: str, config) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = DTYPES.get(config_dtype)
    # float16 matmuls are slow and overflow-prone on CPU; bfloat16 keeps the range.
    return {torch.bfloat16: torch.bfloat16}.get(config_dtype, torch.float32)


def load_model(model_path: str, dtype: torch.dtype, device: str = "cpu") -> DecoderForCausalLM:
    config = load_config(model_path)
    architecture = architecture_of(config)
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderForCausalLM(config, FAMILIES[architecture])
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(_iter_safetensors(files))
    return model.eval()


def _iter_safetensors(files: list[str]):
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
