"""Tiny random-weight models of every supported architecture, saved as real HF model directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    # Larger than the usual 0.02, so logits are peaked and greedy choices are far from ties.
    initializer_range=0.3,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
        },
    ),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    # A short window so prompts in the tests cross it.
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=24, tie_word_embeddings=False),
}


def build_tiny_model(arch: str, directory: Path, tokenizer_dir: Path, **overrides) -> Path:
    """overrides: config fields to change (a kernel's supported head_dim, a smaller vocabulary)."""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


IMAGE_SIZE, PATCH = 32, 8  # a tiny CLIP tower: 16 patches, so 16 tokens per image


def build_tiny_llava(directory: Path, tokenizer_dir: Path) -> Path:
    """LlavaForConditionalGeneration: the tiny Llama text model, a 2-layer CLIP tower on 32x32 images and its
    projector, the default model's tokenizer with an `<image>` token, and a CLIP image processor (the PIL one:
    no torchvision)."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)}, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, initializer_range=0.3)
    config = LlavaConfig(text_config=text, vision_config=vision, projector_hidden_act="gelu",
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                         vision_feature_select_strategy="default", initializer_range=0.3)
    LlavaForConditionalGeneration(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(directory)
    return directory
