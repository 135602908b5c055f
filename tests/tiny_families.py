"""Tiny random models of the families beyond Llama: each config sets the features the family adds at sizes where
the tests' prompts exercise them (windows the prompts cross, a LongRoPE original context they outgrow)."""

from __future__ import annotations

from pathlib import Path

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    Olmo2Config,
    Phi3Config,
    SmolLM3Config,
)

from tiny_models import COMMON, build_tiny_model

LAYERS = 4
SHAPE = COMMON | {"num_hidden_layers": LAYERS}
# LongRoPE's original context: the tests' long prompts start past it, their short ones end before it, so both
# factor sets are used (a request that crosses it while decoding is the case HF recomputes; see rotary.py).
PHI_LONG_CONTEXT = 24


def head_dim(shape: dict) -> int:
    return shape["hidden_size"] // shape["num_attention_heads"]


def gemma2(shape: dict) -> Gemma2Config:
    return Gemma2Config(**shape, head_dim=head_dim(shape), query_pre_attn_scalar=24, sliding_window=12,
                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def gemma3(shape: dict) -> Gemma3TextConfig:
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
    return Gemma3TextConfig(**shape, head_dim=head_dim(shape), query_pre_attn_scalar=16, sliding_window=12,
                            sliding_window_pattern=2, rope_parameters=rope, tie_word_embeddings=True)


def phi3(shape: dict) -> Phi3Config:
    frequencies = head_dim(shape) // 2  # LongRoPE has a factor per rotary frequency
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": PHI_LONG_CONTEXT,
            "short_factor": [1.0 + 0.1 * i for i in range(frequencies)],
            "long_factor": [1.0 + 0.7 * i for i in range(frequencies)]}
    return Phi3Config(**shape | {"max_position_embeddings": 8 * PHI_LONG_CONTEXT}, tie_word_embeddings=False,
                      original_max_position_embeddings=PHI_LONG_CONTEXT, rope_parameters=rope)


def phi4(shape: dict) -> Phi3Config:
    """Phi-4-mini: rotary over the first 3/4 of each head, the rest position-free."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return Phi3Config(**shape, tie_word_embeddings=True, rope_parameters=rope)


def smollm3(shape: dict) -> SmolLM3Config:
    """Every fourth layer without rotary, as SmolLM3-3B."""
    uses_rope = [int((i + 1) % 4 != 0) for i in range(shape["num_hidden_layers"])]
    return SmolLM3Config(**shape, no_rope_layers=uses_rope, tie_word_embeddings=True)


def olmo2(shape: dict) -> Olmo2Config:
    return Olmo2Config(**shape, tie_word_embeddings=False)


def granite(shape: dict) -> GraniteConfig:
    return GraniteConfig(**shape, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
                         logits_scaling=2.5, tie_word_embeddings=True)


FAMILY_CONFIGS = {build.__name__: build for build in (gemma2, gemma3, phi3, phi4, smollm3, olmo2, granite)}
FAMILY_NAMES = sorted(FAMILY_CONFIGS)
# Families whose shapes split two ways (all of them here) that the tensor-parallel test runs: one per new kind
# of sharded parameter (sandwich norms and soft caps; projection-wide q/k norms; fused checkpoint tensors).
TP_FAMILIES = ("gemma2", "olmo2", "phi3")


def build_family_model(family: str, directory: Path, tokenizer_dir: Path, shape: dict = SHAPE) -> Path:
    """shape: the config fields every family shares (benchmarks/families.py passes a bigger one)."""
    return build_tiny_model(family, directory, tokenizer_dir, config=FAMILY_CONFIGS[family](shape))
