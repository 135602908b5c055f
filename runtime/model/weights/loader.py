"""Load a model directory (config.json + safetensors shards) into our decoder implementation."""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from transformers import AutoConfig

from ...distributed.parallel_state import SINGLE, TensorParallel
from ..decoder import DecoderForCausalLM
from ..families import FAMILIES
from ..vision import text_weight_name
from .checkpoint import architecture_of, load_config, vision_architecture

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, config, device: str = "cpu") -> torch.dtype:
    """auto on CUDA: the checkpoint's float16, else bfloat16 (float32 checkpoints too, as SGLang and vLLM do: tensor
    cores and half the bytes read per step). auto on CPU: bfloat16 where the CPU computes it natively (its matmuls
    ran 2-3x float32's at batch 32 on an avx512_bf16 core) or the checkpoint is bfloat16, float32 otherwise.
    float16 matmuls are slow and overflow-prone on CPU, so a float16 checkpoint runs in one of the two there."""
    if dtype != "auto":
        return DTYPES[dtype]
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = DTYPES.get(config_dtype)
    if device.startswith("cuda"):
        return torch.float16 if config_dtype == torch.float16 else torch.bfloat16
    if config_dtype == torch.bfloat16 or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: the instructions oneDNN's bfloat16 matmuls need to beat float32, where oneDNN may use them
    (ONEDNN_MAX_CPU_ISA=AVX2, say, holds it to a CPU without them)."""
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(hardware and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")


def load_model(model_path: str, dtype: torch.dtype, device: str = "cpu",
               tp: TensorParallel = SINGLE) -> DecoderForCausalLM:
    """The model, or with tp this rank's shard of it (each tensor is cut as it is read)."""
    config = load_config(model_path)
    architecture = architecture_of(config)
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderForCausalLM(config, FAMILIES[architecture], tp)
    finally:
        torch.set_default_dtype(previous)
    multimodal = vision_architecture(AutoConfig.from_pretrained(model_path)) is not None
    model.load_weights(_iter_safetensors(files, multimodal))
    return model.eval()


def _iter_safetensors(files: list[str], multimodal: bool = False):
    """HF-named text-model tensors (a vision-language checkpoint's vision tensors are the encoder's)."""
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                ours = text_weight_name(name, multimodal)
                if ours is not None:
                    yield ours, handle.get_tensor(name)
