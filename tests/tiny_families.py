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
HEAD_HALF = 8  # head_dim 16: LongRoPE factors per rotary frequency

FAMILY_CONFIGS = {
    "gemma2": lambda: Gemma2Config(
        **SHAPE, head_dim=16, query_pre_attn_scalar=24, sliding_window=12, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma3": lambda: Gemma3TextConfig(
        **SHAPE, head_dim=16, query_pre_attn_scalar=16, sliding_window=12, sliding_window_pattern=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        tie_word_embeddings=True),
    "phi3": lambda: Phi3Config(
        **SHAPE | {"max_position_embeddings": 8 * PHI_LONG_CONTEXT}, tie_word_embeddings=False,
        original_max_position_embeddings=PHI_LONG_CONTEXT,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "original_max_position_embeddings": PHI_LONG_CONTEXT,
                         "short_factor": [1.0 + 0.1 * i for i in range(HEAD_HALF)],
                         "long_factor": [1.0 + 0.7 * i for i in range(HEAD_HALF)]}),
    # Phi-4-mini: rotary over the first 3/4 of each head, the rest position-free.
    "phi4": lambda: Phi3Config(
        **SHAPE, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    "smollm3": lambda: SmolLM3Config(**SHAPE, no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=True),
    "olmo2": lambda: Olmo2Config(**SHAPE, tie_word_embeddings=False),
    "granite": lambda: GraniteConfig(
        **SHAPE, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.5,
        tie_word_embeddings=True),
}
FAMILY_NAMES = sorted(FAMILY_CONFIGS)
# Families whose shapes split two ways (all of them here) that the tensor-parallel test runs: one per new kind
# of sharded parameter (sandwich norms and soft caps; projection-wide q/k norms; fused checkpoint tensors).
TP_FAMILIES = ("gemma2", "olmo2", "phi3")


def build_family_model(family: str, directory: Path, tokenizer_dir: Path) -> Path:
    return build_tiny_model(family, directory, tokenizer_dir, config=FAMILY_CONFIGS[family]())
