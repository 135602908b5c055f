"""The GGUF architectures furcate converts, in Hugging Face terms: one frozen table per architecture with the
HF architecture, a config builder from the GGUF metadata, the tensor name map, which tensors llama.cpp's
converter permuted and what it added to the norm weights.

The tables follow transformers' own GGUF loading (integrations/ggml.py, modeling_gguf_pytorch_utils.py) and
llama.cpp's convert_hf_to_gguf.py where transformers leaves a field at its config class's default although the
file (or llama.cpp's runtime) says otherwise: qwen3's and llama's head_dim (`attention.key_length`), Gemma's
query_pre_attn_scalar, Phi-3's sliding window, partial rotary factor and LongRoPE factors.
"""

from __future__ import annotations

import pathlib
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf.quants import dequantize
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from .gguf_reader import GGUFFile, GGUFTensor, read_gguf


@dataclass(frozen=True)
class GGUFMeta:
    """A GGUF file's metadata (vocabulary arrays as their lengths) and its tensors by GGUF name."""

    values: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def arch(self) -> str:
        return self.values["general.architecture"]

    def key(self, name: str) -> Any:
        """The architecture's metadata key `name`, which the file must have."""
        try:
            return self.values[f"{self.arch}.{name}"]
        except KeyError:
            raise ValueError(f"GGUF metadata has no {self.arch}.{name}") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{name}", default)

    def floats(self, tensor: str) -> list[float]:
        """A small float tensor's values (LongRoPE's factors), as a config stores them."""
        found = self.tensors[tensor]
        return [float(x) for x in dequantize(found.data, found.tensor_type).reshape(-1)]


def open_gguf(path: str | pathlib.Path) -> tuple[GGUFFile, GGUFMeta]:
    """The file and its metadata; a file that is not a whole GGUF is a clear error."""
    try:
        gguf = read_gguf(str(path))
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, struct.error) as error:
        raise ValueError(f"{pathlib.Path(path).name} is not a readable GGUF file (truncated or corrupt?): "
                         f"{error}") from error
    return gguf, GGUFMeta(gguf.values, {t.name: t for t in gguf.tensors})


# Config builders. Every GGUF states its shape in the same keys; each family adds its own.

def _eps(meta: GGUFMeta) -> float:
    # GGUF stores eps as float32 (9.9999997e-06); 7 significant digits give back 1e-05.
    return float(f"{meta.key('attention.layer_norm_rms_epsilon'):.7g}")


def _head_dim(meta: GGUFMeta) -> int:
    # llama.cpp writes key_length when a config states head_dim; else heads split the width evenly.
    return meta.get("attention.key_length") or meta.key("embedding_length") // meta.key("attention.head_count")


def _rope(meta: GGUFMeta, default_theta: float = 10000.0) -> dict:
    return {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", default_theta))}


def _shape(meta: GGUFMeta) -> dict:
    """The config fields every family shares, and what llama.cpp writes for them."""
    return dict(
        # Only llama writes vocab_size; the embedding's rows are the vocabulary (GGUF lists them last).
        vocab_size=meta.get("vocab_size") or int(meta.tensors["token_embd.weight"].shape[-1]),
        hidden_size=meta.key("embedding_length"),
        intermediate_size=meta.key("feed_forward_length"),
        num_hidden_layers=meta.key("block_count"),
        num_attention_heads=meta.key("attention.head_count"),
        num_key_value_heads=meta.key("attention.head_count_kv"),
        max_position_embeddings=meta.key("context_length"),
        rms_norm_eps=_eps(meta),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        tie_word_embeddings="output.weight" not in meta.tensors,
        bos_token_id=meta.values.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.values.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.values.get("tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )


def _llama_config(meta: GGUFMeta) -> LlamaConfig:
    head_dim = _head_dim(meta)
    if meta.get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported for llama")
    if "rope_freqs.weight" in meta.tensors:
        # Llama 3.1+'s rope scaling, which llama.cpp stores only as these per-frequency divisors (no rope_scaling
        # keys to rebuild HF's llama3 rope from). transformers drops them and rotates unscaled; refused instead.
        raise ValueError("this llama GGUF scales its rotary frequencies by a rope_freqs tensor (Llama 3.1 and "
                         "later), which furcate does not convert; load the model's Hugging Face directory instead")
    return LlamaConfig(**_shape(meta), head_dim=head_dim, rope_parameters=_rope(meta))


def _qwen2_config(meta: GGUFMeta) -> Qwen2Config:
    return Qwen2Config(**_shape(meta), rope_parameters=_rope(meta))


def _qwen3_config(meta: GGUFMeta) -> Qwen3Config:
    return Qwen3Config(**_shape(meta), head_dim=_head_dim(meta), rope_parameters=_rope(meta))


def _query_scale(meta: GGUFMeta, big_model_layers: int) -> int:
    """Gemma's query_pre_attn_scalar, which no GGUF stores: llama.cpp scales queries by head_dim, except for the
    27B models (told apart by their layer count), which use hidden_size / heads as their HF configs do."""
    if meta.key("block_count") == big_model_layers:
        return meta.key("embedding_length") // meta.key("attention.head_count")
    return _head_dim(meta)


def _gemma2_config(meta: GGUFMeta) -> Gemma2Config:
    return Gemma2Config(
        **_shape(meta), head_dim=_head_dim(meta), rope_parameters=_rope(meta),
        query_pre_attn_scalar=_query_scale(meta, 46), sliding_window=meta.key("attention.sliding_window"),
        attn_logit_softcapping=meta.get("attn_logit_softcapping"),
        final_logit_softcapping=meta.get("final_logit_softcapping"),
    )


def _gemma3_global_rope(meta: GGUFMeta) -> dict:
    rope = _rope(meta, default_theta=1_000_000.0)
    # Gemma 3 4B and up stretch their global layers' positions linearly; the local ones never.
    if meta.get("rope.scaling.type") == "linear":
        rope |= {"rope_type": "linear", "factor": float(meta.key("rope.scaling.factor"))}
    return rope


def _gemma3_config(meta: GGUFMeta) -> Gemma3TextConfig:
    # llama.cpp's local layers use base 10000 unless the file says otherwise.
    local = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
    return Gemma3TextConfig(
        **_shape(meta), head_dim=_head_dim(meta), query_pre_attn_scalar=_query_scale(meta, 62),
        sliding_window=meta.key("attention.sliding_window"),
        rope_parameters={"full_attention": _gemma3_global_rope(meta), "sliding_attention": local},
    )


def _phi3_rope(meta: GGUFMeta) -> dict:
    head_dim = meta.key("embedding_length") // meta.key("attention.head_count")
    rope = _rope(meta) | {"partial_rotary_factor": meta.get("rope.dimension_count", head_dim) / head_dim}
    if "rope_factors_long.weight" not in meta.tensors:
        return rope
    return rope | {"rope_type": "longrope", "long_factor": meta.floats("rope_factors_long.weight"),
                   "short_factor": meta.floats("rope_factors_short.weight")}


def _phi3_config(meta: GGUFMeta) -> Phi3Config:
    context = meta.key("context_length")
    return Phi3Config(
        **_shape(meta), rope_parameters=_phi3_rope(meta),
        original_max_position_embeddings=meta.get("rope.scaling.original_context_length", context),
        # llama.cpp writes 0 for a model without one (Phi-4-mini).
        sliding_window=meta.get("attention.sliding_window") or None,
    )


# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."), per family.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2 and 3 norm both sides of attention and of the MLP; llama.cpp's ffn_norm is the MLP's first.
_GEMMA_LAYER = _LLAMA_LAYER | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's checkpoints fuse q/k/v and gate/up themselves; the GGUF keeps them fused.
_PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture maps onto its HF model."""

    hf_architecture: str
    config: Callable[[GGUFMeta], PretrainedConfig]
    layer_names: Mapping[str, str]
    # GGUF layer tensors whose rows llama.cpp permuted into its interleaved rope order (llama's q and k).
    permuted: frozenset[str] = frozenset()
    # What llama.cpp's converter added to every norm weight (Gemma's norms scale by 1 + w; GGUF stores 1 + w).
    norm_offset: float = 0.0
    # Global tensors that are config, not weights (Phi-3's LongRoPE factors), or that transformers drops.
    not_weights: frozenset[str] = field(default_factory=frozenset)

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF tensor name of a GGUF tensor; None for one that holds no weight."""
        stem, suffix = gguf_name.rsplit(".", 1)
        if stem in self.not_weights:
            return None
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            return f"model.layers.{layer}.{self._known(part, self.layer_names)}.{suffix}"
        return f"{self._known(stem, _GLOBAL)}.{suffix}"

    def _known(self, part: str, names: Mapping[str, str]) -> str:
        if part not in names:
            raise ValueError(f"GGUF tensor {part!r} has no counterpart in {self.hf_architecture}")
        return names[part]

    def rope_heads(self, gguf_name: str, meta: GGUFMeta) -> int:
        """The head count a permuted tensor's rows were permuted by; 0 for a tensor left as HF wrote it."""
        part = gguf_name.rsplit(".", 2)[-2]
        if part not in self.permuted:
            return 0
        return meta.key("attention.head_count" if part == "attn_q" else "attention.head_count_kv")

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.endswith("norm.weight")


ARCHS = {
    "llama": GGUFArch("LlamaForCausalLM", _llama_config, _LLAMA_LAYER, frozenset({"attn_q", "attn_k"}),
                      not_weights=frozenset({"rope_freqs"})),
    "qwen2": GGUFArch("Qwen2ForCausalLM", _qwen2_config, _LLAMA_LAYER),
    "qwen3": GGUFArch("Qwen3ForCausalLM", _qwen3_config, _LLAMA_LAYER | _QK_NORMS),
    "gemma2": GGUFArch("Gemma2ForCausalLM", _gemma2_config, _GEMMA_LAYER, norm_offset=1.0),
    "gemma3": GGUFArch("Gemma3ForCausalLM", _gemma3_config, _GEMMA_LAYER | _QK_NORMS, norm_offset=1.0),
    "phi3": GGUFArch("Phi3ForCausalLM", _phi3_config, _PHI3_LAYER,
                     not_weights=frozenset({"rope_factors_long", "rope_factors_short"})),
}


def gguf_arch(meta: GGUFMeta) -> GGUFArch:
    if meta.arch not in ARCHS:
        raise ValueError(f"unsupported GGUF architecture {meta.arch!r}; furcate reads {sorted(ARCHS)}")
    return ARCHS[meta.arch]


def hf_config(meta: GGUFMeta) -> PretrainedConfig:
    arch = gguf_arch(meta)
    config = arch.config(meta)
    config.architectures = [arch.hf_architecture]
    return config


def hf_weight(arch: GGUFArch, meta: GGUFMeta, tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as float32 in HF's layout: dequantized, rope rows back in HF's order, norms unshifted."""
    weight = dequantize(tensor.data, tensor.tensor_type)
    heads = arch.rope_heads(tensor.name, meta)
    if heads:
        weight = unpermute_rope(weight, heads)
    if arch.norm_offset and arch.is_norm(tensor.name):
        weight = weight - np.float32(arch.norm_offset)
    return np.array(weight, dtype=np.float32, order="C")


def unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotates halves, ggml rotates interleaved pairs)."""
    pairs = weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def rope_row_order(rows: int, n_head: int) -> np.ndarray:
    """The row permutation unpermute_rope applies, as indices (for tensors kept in blocks)."""
    return unpermute_rope(np.arange(rows)[:, None], n_head)[:, 0]
