"""GGUF (llama.cpp) tensor names and layout, in Hugging Face terms."""

from __future__ import annotations

import numpy as np

# GGUF tensor name (after "blk.N.") -> HF llama name (after "model.layers.N.").
_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotates halves, ggml rotates interleaved pairs)."""
    pairs = weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def rope_row_order(rows: int, n_head: int) -> np.ndarray:
    """The row permutation unpermute_rope applies, as indices (for tensors kept in blocks)."""
    return unpermute_rope(np.arange(rows)[:, None], n_head)[:, 0]
