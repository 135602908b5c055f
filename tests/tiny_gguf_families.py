"""Tiny GGUFs of every architecture furcate converts, written FROM a tiny random HF model the way llama.cpp's
convert_hf_to_gguf.py writes one: tensor names from gguf's own name map (the one transformers loads with), llama's
q/k rows permuted, Gemma's norms stored as 1 + w, a tied LM head left out, metadata under llama.cpp's keys, and
the default model's byte-level tokenizer. Also Q4_K / Q6_K blocks written by hand (gguf.quants quantizes
neither); any valid blocks do, since the tests compare against gguf.quants.dequantize of what is written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, RopeScalingType, get_tensor_name_map
from gguf import GGMLQuantizationType as Q
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tiny_gguf import _permute_rope, write_tokenizer

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=2, initializer_range=0.3)
ROTARY_HALF = 8  # Phi-3's head_dim 16 has 8 rotary frequencies, each with a LongRoPE factor

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # query_pre_attn_scalar = head_dim, as llama.cpp runs every Gemma but the 27B ones; a window prompts cross.
    "gemma2": lambda: Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=24,
                                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON, head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi3": lambda: Phi3Config(
        **COMMON, tie_word_embeddings=False, sliding_window=47, original_max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "long_factor": [1.0 + i / 4 for i in range(ROTARY_HALF)],
                         "short_factor": [1.0 + i / 16 for i in range(ROTARY_HALF)]}),
}
# llama.cpp's converter permutes q/k rows for llama only.
PERMUTED = {"llama"}
GEMMA = {"gemma2", "gemma3"}
PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3": "qwen2"}  # the others write SmolLM2's own rule


def build_hf_model(arch: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A random HF model of `arch`, its norm weights randomized too (Gemma's start at zero, llama's at one)."""
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def write_gguf(model: PreTrainedModel, arch: str, path: Path, default_gguf: Path,
               types: Callable[[str], Q] | None = None) -> Path:
    """`model` as llama.cpp would write it; types: GGUF tensor name -> type of a 2-D weight (F32 by default)."""
    config = model.config
    writer = GGUFWriter(str(path), arch)
    _write_shape(writer, arch, config)
    _EXTRA_KEYS.get(arch, lambda w, c: None)(writer, config)
    write_tokenizer(writer, default_gguf, PRE_TOKENIZER.get(arch, "smollm"))
    for name, data in _gguf_tensors(model, arch):
        qtype = types(name) if types and data.ndim == 2 else Q.F32
        writer.add_tensor(name, QUANTIZERS[qtype](data), raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_shape(writer: GGUFWriter, arch: str, config: PretrainedConfig) -> None:
    """TextModel.set_gguf_parameters's keys (Gemma 2 writes no rope base)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "gemma2":
        writer.add_rope_freq_base(_rope(config)["rope_theta"])
    if "head_dim" in config.to_dict():
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)


def _rope(config: PretrainedConfig) -> dict:
    return config.rope_parameters.get("full_attention", config.rope_parameters)


def _llama_keys(writer: GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)


def _gemma2_keys(writer: GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def _gemma3_keys(writer: GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_scaling_type(RopeScalingType(_rope(config)["rope_type"]))
    writer.add_rope_scaling_factor(_rope(config)["factor"])


def _phi3_keys(writer: GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_sliding_window(config.sliding_window)


_EXTRA_KEYS = {"llama": _llama_keys, "gemma2": _gemma2_keys, "gemma3": _gemma3_keys, "phi3": _phi3_keys}


def _gguf_tensors(model: PreTrainedModel, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data) of every tensor llama.cpp's converter writes for `model`."""
    config = model.config
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers)
    found = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        found.append((name, _as_written(arch, config, name, tensor.numpy())))
    return found + _phi3_factors(config) if arch == "phi3" else found


def _as_written(arch: str, config: PretrainedConfig, name: str, data: np.ndarray) -> np.ndarray:
    if arch in PERMUTED and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        return _permute_rope(data, heads)
    if arch in GEMMA and name.endswith("norm.weight"):
        return data + np.float32(1)
    return data


def _phi3_factors(config: PretrainedConfig) -> list[tuple[str, np.ndarray]]:
    rope = config.rope_parameters
    if rope.get("rope_type") != "longrope":
        return []
    return [(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
            for kind in ("long", "short")]


# Hand-written K-quant blocks: the layouts of gguf.quants' Q4_K / Q6_K dequantizers, run backwards.

def _nonzero(values: np.ndarray) -> np.ndarray:
    # An all-zero block (the embedding's padding row) has zero scales; any quant restores it, so divide by 1.
    return np.where(values > 0, values, 1).astype(np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """Q4_K blocks (uint8 [rows, bytes]): per 32 weights an unsigned 4-bit grid from a min to the max."""
    rows = weight.shape[0]
    w = weight.reshape(rows, -1, 8, 32).astype(np.float32)
    low, high = np.minimum(w.min(-1), 0), w.max(-1)
    step, floor = (high - low) / 15, -low
    d, dmin = (step.max(-1) / 63).astype(np.float16), (floor.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(step / _nonzero(d[..., None])), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(floor / _nonzero(dmin[..., None])), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.round((w + offset[..., None]) / _nonzero(scale[..., None])), 0, 15).astype(np.uint8)
    packed = q.reshape(*q.shape[:2], 4, 2, 32)
    quants = packed[..., 0, :] | (packed[..., 1, :] << 4)
    blocks = [_f16_bytes(d), _f16_bytes(dmin), _pack_q4_k_scales(sc, mn), quants.reshape(*q.shape[:2], 128)]
    return np.concatenate(blocks, axis=-1).reshape(rows, -1)


def _pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in 12 bytes (gguf.quants.Q4_K.get_scale_min's layout)."""
    first = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mins = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    rest = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([first, mins, rest], axis=-1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """Q6_K blocks (uint8 [rows, bytes]): per 16 weights a signed 6-bit grid with an int8 scale."""
    rows = weight.shape[0]
    w = weight.reshape(rows, -1, 16, 16).astype(np.float32)
    step = np.abs(w).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(step / _nonzero(d[..., None])), 1, 127).astype(np.int8)
    scale = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.round(w / _nonzero(scale[..., None])), -32, 31) + 32).astype(np.uint8).reshape(*w.shape[:2], 256)
    low = (q & 15).reshape(*w.shape[:2], 2, 2, 64)
    high = (q >> 4).reshape(*w.shape[:2], 2, 4, 32)
    ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*w.shape[:2], 128)
    qh = sum(high[..., s, :] << (2 * s) for s in range(4)).astype(np.uint8).reshape(*w.shape[:2], 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1).reshape(rows, -1)


QUANTIZERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: lambda data: data.astype(np.float32), Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}
