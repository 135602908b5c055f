"""The architectures furcate runs, each a set of flags of the one decoder (decoder.py).

Families differ in attention biases, q/k norms, norm arithmetic and placement, activation, sliding windows, rotary
(rotary.py), a few constant multipliers and, for the mixture-of-experts families, the sparse MLP block (moe.py);
everything else is the Llama forward. A family that needs more than flags (cross-attention) is not listed here, and
a checkpoint of an architecture not listed is refused at load with this list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .moe import MOE_STYLES, MoeStyle


@dataclass(frozen=True)
class Scales:
    """Constant multipliers some families apply; None where the family applies none."""

    embed: float | None = None  # token embeddings times this (Gemma: sqrt(hidden); Granite: its multiplier)
    residual: float | None = None  # each block's output times this before the residual add (Granite)
    attention: float | None = None  # the softmax scale in place of head_dim ** -0.5
    logit_divisor: float | None = None  # logits divided by this (Granite)
    final_logit_cap: float | None = None  # tanh soft-capping of the logits (Gemma 2)
    attention_logit_cap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)


def no_scales(config) -> Scales:
    return Scales()


def gemma_scales(config) -> Scales:
    return Scales(embed=config.hidden_size**0.5, attention=config.query_pre_attn_scalar**-0.5,
                  final_logit_cap=getattr(config, "final_logit_softcapping", None),
                  attention_logit_cap=getattr(config, "attn_logit_softcapping", None))


def granite_scales(config) -> Scales:
    return Scales(embed=config.embedding_multiplier, residual=config.residual_multiplier,
                  attention=config.attention_multiplier, logit_divisor=config.logits_scaling)


@dataclass(frozen=True)
class Family:
    qkv_bias: bool | None  # None: read the config's qkv_bias_field
    o_bias: bool | None
    qk_norm: str | None = None  # "head": one norm per head (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    # Mistral-style configs carry a model-wide sliding_window with no per-layer types.
    window_from_config: bool = False
    norm_style: str = "llama"  # layers.RMSNorm's arithmetic: "llama", "olmo", "gemma"
    # Where a block's norms sit: "pre" (before attention and MLP), "sandwich" (before and after each: Gemma),
    # "post" (after each, none before: OLMo 2).
    layout: str = "pre"
    activation_field: str = "hidden_act"  # the config field naming the MLP's activation
    scales: Callable[[object], Scales] = no_scales
    qkv_bias_field: str = "attention_bias"  # Qwen2-MoE names its q/k/v bias flag qkv_bias
    moe: MoeStyle | None = None  # the sparse MLP block of a mixture-of-experts family (its dense layers: GatedMLP)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(qkv_bias=None, o_bias=None),
    "MistralForCausalLM": Family(qkv_bias=False, o_bias=False, window_from_config=True),
    "Qwen2ForCausalLM": Family(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Family(qkv_bias=None, o_bias=False, qk_norm="head"),
    "Gemma2ForCausalLM": Family(qkv_bias=None, o_bias=None, norm_style="gemma", layout="sandwich",
                                activation_field="hidden_activation", scales=gemma_scales),
    "Gemma3ForCausalLM": Family(qkv_bias=None, o_bias=None, qk_norm="head", norm_style="gemma",
                                layout="sandwich", activation_field="hidden_activation", scales=gemma_scales),
    "Phi3ForCausalLM": Family(qkv_bias=False, o_bias=False, window_from_config=True),
    "SmolLM3ForCausalLM": Family(qkv_bias=None, o_bias=None),
    "Olmo2ForCausalLM": Family(qkv_bias=None, o_bias=None, qk_norm="projection", norm_style="olmo",
                               layout="post"),
    "GraniteForCausalLM": Family(qkv_bias=None, o_bias=None, scales=granite_scales),
    "Qwen3MoeForCausalLM": Family(qkv_bias=None, o_bias=None, qk_norm="head", window_from_config=True,
                                  moe=MOE_STYLES["Qwen3MoeForCausalLM"]),
    "Qwen2MoeForCausalLM": Family(qkv_bias=None, o_bias=False, qkv_bias_field="qkv_bias",
                                  moe=MOE_STYLES["Qwen2MoeForCausalLM"]),
    "MixtralForCausalLM": Family(qkv_bias=False, o_bias=False, window_from_config=True,
                                 moe=MOE_STYLES["MixtralForCausalLM"]),
    "OlmoeForCausalLM": Family(qkv_bias=None, o_bias=None, qk_norm="projection",
                               moe=MOE_STYLES["OlmoeForCausalLM"]),
}

# model_type of configs without `architectures` (Gemma 3's text model is "gemma3_text", Qwen's MoE "qwen3_moe").
MODEL_TYPES = {name.removesuffix("ForCausalLM").lower(): name for name in FAMILIES} | {
    "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def layer_window(config, family: Family, layer_id: int) -> int | None:
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 and SmolLM3 list layer types regardless
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return config.sliding_window if layer_types[layer_id] == "sliding_attention" else None
    return getattr(config, "sliding_window", None) if family.window_from_config else None


def refusal(config) -> str | None:
    """Why a config of a listed architecture still cannot run, or None."""
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model) is not a decoder furcate serves"
    return None
