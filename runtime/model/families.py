"""The architectures furcate runs, each a set of flags of the one decoder (decoder.py).

Families differ in attention biases, q/k norms, norm arithmetic and placement, activation, sliding windows, rotary
(rotary.py), a few constant multipliers and, for the mixture-of-experts families, the sparse MLP block (moe.py);
everything else is the Llama forward. A family that needs more than flags (cross-attention) is not listed here, and
a checkpoint of an architecture not listed is refused at load with this list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeStyle:
    """What differs between the MoE families: config field names, routing arithmetic and checkpoint names."""

    experts_field: str  # config field: number of routed experts
    intermediate_field: str  # config field: one expert's intermediate size
    renormalize: bool | None  # top-k weights rescaled to sum to 1; None: config.norm_topk_prob decides
    # Qwen and OLMoE cast the top-k weights to the activations' dtype before scaling; Mixtral keeps float32.
    weights_in_input_dtype: bool = True
    shared_expert: bool = False  # Qwen2-MoE: a dense expert every token takes, scaled by a sigmoid gate
    checkpoint_module: str = "mlp"  # the block's name in HF checkpoints (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    top_k_field: str = "num_experts_per_tok"

    def is_sparse_layer(self, config, layer_id: int) -> bool:
        """HF's rule: Qwen's `mlp_only_layers` and `decoder_sparse_step` make some layers dense; configs without
        them (Mixtral, OLMoE) are sparse in every layer."""
        dense = getattr(config, "mlp_only_layers", None) or []
        step = getattr(config, "decoder_sparse_step", None) or 1
        return layer_id not in dense and getattr(config, self.experts_field) > 0 and (layer_id + 1) % step == 0

    def renormalizes(self, config) -> bool:
        return bool(config.norm_topk_prob) if self.renormalize is None else self.renormalize


MOE_STYLES: dict[str, MoeStyle] = {
    "Qwen3MoeForCausalLM": MoeStyle("num_experts", "moe_intermediate_size", renormalize=None),
    "Qwen2MoeForCausalLM": MoeStyle("num_experts", "moe_intermediate_size", renormalize=None, shared_expert=True),
    "OlmoeForCausalLM": MoeStyle("num_experts", "intermediate_size", renormalize=None),
    "MixtralForCausalLM": MoeStyle(
        "num_local_experts", "intermediate_size", renormalize=True, weights_in_input_dtype=False,
        checkpoint_module="block_sparse_moe", expert_names=("w1", "w3", "w2")),
}


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
    """Llama's: no multiplier anywhere."""
    return Scales()


def gemma_scales(config) -> Scales:
    """sqrt(hidden) on the embeddings, query_pre_attn_scalar's softmax scale, Gemma 2's soft caps."""
    return Scales(embed=config.hidden_size**0.5, attention=config.query_pre_attn_scalar**-0.5,
                  final_logit_cap=getattr(config, "final_logit_softcapping", None),
                  attention_logit_cap=getattr(config, "attn_logit_softcapping", None))


def granite_scales(config) -> Scales:
    """Granite's four multipliers, each a config field."""
    return Scales(embed=config.embedding_multiplier, residual=config.residual_multiplier,
                  attention=config.attention_multiplier, logit_divisor=config.logits_scaling)


@dataclass(frozen=True)
class Family:
    """One architecture's flags: what the decoder builds differently for it."""

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
    """Layer layer_id's sliding window (by its layer type, or the model-wide one), None for full attention."""
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 and SmolLM3 list layer types regardless
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return config.sliding_window if layer_types[layer_id] == "sliding_attention" else None
    return getattr(config, "sliding_window", None) if family.window_from_config else None


def refusal(config) -> str | None:
    """Why a config of a listed architecture still cannot run, or None: what the decoder does not serve, and
    values HF would accept but compute garbage from (a zero cap divides by zero; an odd rotary width rotates a
    dimension more than it says)."""
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model) is not a decoder furcate serves"
    uses_rope = getattr(config, "no_rope_layers", None)
    if uses_rope is not None and len(uses_rope) != config.num_hidden_layers:
        return f"no_rope_layers lists {len(uses_rope)} layers of {config.num_hidden_layers}"
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "clip_qkv"):
        value = getattr(config, name, None)
        if value is not None and not value > 0:
            return f"{name} must be positive or null, got {value!r}"
    step = getattr(config, "decoder_sparse_step", None)
    if step is not None and step < 1:
        return f"decoder_sparse_step must be at least 1, got {step!r}"
    return odd_rotary(config)


def odd_rotary(config) -> str | None:
    """Why a (per layer type) partial rotary factor cannot be served, or None."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    for params in (rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]):
        rotary_dim = int(head_dim * (params or {}).get("partial_rotary_factor", 1.0))
        if rotary_dim % 2:
            return f"partial_rotary_factor gives an odd rotary width ({rotary_dim} of head_dim {head_dim})"
    return None
