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
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
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


def build_tiny_model(arch: str, directory: Path, tokenizer_dir: Path, config=None, **overrides) -> Path:
    """config: in place of CONFIGS[arch]'s; overrides: config fields to change (a kernel's supported head_dim, a
    smaller vocabulary)."""
    torch.manual_seed(0)
    config = config or CONFIGS[arch]()
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


IMAGE_SIZE, PATCH = 32, 8  # a tiny CLIP tower: 16 patches, so 16 tokens per image


def build_tiny_llava(directory: Path, tokenizer_dir: Path, chat_template: str | None = None) -> Path:
    """LlavaForConditionalGeneration: the tiny Llama text model, a 2-layer CLIP tower on 32x32 images and its
    projector, the default model's tokenizer with an `<image>` token (and `chat_template` in place of its own, if
    given), and a CLIP image processor (the PIL one: no torchvision)."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = chat_template or tokenizer.chat_template
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


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PATCH, QWEN_MERGE = 8, 2  # an image of H x W pixels (rounded to 16s) takes (H / 16) * (W / 16) tokens
QWEN_VISION = {
    # Qwen2-VL: embed_dim wide blocks, merged to the text model's width.
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    # Qwen2.5-VL: windows of 2 x 2 merged tokens (32 pixels) in block 0, full attention in block 1.
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                       window_size=32, fullatt_block_indexes=[1]),
}


def build_tiny_qwen_vl(kind: str, directory: Path, tokenizer_dir: Path, chat_template: str | None = None) -> Path:
    """Qwen2VLForConditionalGeneration (kind "qwen2_vl") or Qwen2_5_VLForConditionalGeneration ("qwen2_5_vl"): a
    tiny Qwen2 text model with M-RoPE, a 2-block vision transformer on 8-pixel patches merged 2 x 2, the default
    model's tokenizer with Qwen2-VL's vision tokens, and the image processor (the PIL one: no torchvision) sizing
    images to 32x32 .. 64x64 pixels, so an image takes 4 to 16 tokens. `chat_template`: in place of the
    tokenizer's own, if given."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tokenizer.chat_template = chat_template or tokenizer.chat_template
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_VL_TOKENS)))
    # head_dim 16: 8 rotary frequencies, 2 temporal, 3 height, 3 width.
    text = {**COMMON, "vocab_size": len(tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = {**QWEN_VISION[kind], "patch_size": QWEN_PATCH, "spatial_merge_size": QWEN_MERGE,
              "temporal_patch_size": 2, "initializer_range": 0.3}
    config_class, model_class = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
                                 "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)}[kind]
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    model_class(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=2,
                             min_pixels=32 * 32, max_pixels=64 * 64).save_pretrained(directory)
    return directory


TEMPLATES = Path(__file__).parent / "chat_templates"
# The tiny chat models of the tool and reasoning tests: an architecture, its family's real chat template
# (tests/chat_templates/), and the tokens that family's tokenizer has as single tokens (special ones are control
# tokens, left out of decoded text as in the real tokenizer).
CHAT_MODELS = {
    "qwen2.5": ("qwen2", ["<tool_call>", "</tool_call>"], []),
    "llama3.1": ("llama", [], []),
    "mistral": ("mistral", [], ["[TOOL_CALLS]"]),
    "qwen3": ("qwen3", ["<think>", "</think>", "<tool_call>", "</tool_call>"], []),
}


def build_tiny_chat_model(family: str, directory: Path, tokenizer_dir: Path) -> Path:
    """A tiny random model of `family` (a CHAT_MODELS key) whose tokenizer is the default model's with the family's
    tokens added and the family's chat template."""
    arch, tokens, special = CHAT_MODELS[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(tokens)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    build_tiny_model(arch, directory, tokenizer_dir, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(directory)
    return directory
