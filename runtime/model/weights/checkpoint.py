"""What the caller's process reads of a checkpoint before any model is built: where it is (the default model and
GGUF files converted on first use), its decoder config and architecture, its vision facts, whether tensor
parallelism can split it. Torch-free, and nothing of the architecture's modules: the model itself is built in the
scheduler process (loader.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import AutoConfig

from ..families import FAMILIES, MODEL_TYPES, refusal

# Each architecture's vision tower in transformers: (module, class), imported only when a model needs it (the
# modeling modules cost ~1.5 s to import, paid by every engine start otherwise).
QWEN_TOWERS = {
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
}
# The text model's architecture; None: found by its config's model_type (LLaVA's may be any Llama-like model).
VISION_ARCHITECTURES: dict[str, str | None] = {"LlavaForConditionalGeneration": None,
                                               **dict.fromkeys(QWEN_TOWERS, "Qwen2ForCausalLM")}


@dataclass(frozen=True)
class VisionSpec:
    """What the rest of furcate needs to know of a vision-language model."""

    architecture: str
    image_token_id: int  # the placeholder token of one image position in the prompt
    # LLaVA: fixed, (image_size / patch_size)^2 (+1 with the CLS token kept); None: each image's own (Qwen2-VL:
    # its patch grid over merge_size^2).
    tokens_per_image: int | None
    merge_size: int = 1  # Qwen2-VL: patches merged into one token along each side (spatial_merge_size)
    # Tokens a prompt puts around the placeholder (Qwen2-VL's <|vision_start|> and <|vision_end|>), or none.
    wrap_token_ids: tuple[int, int] | None = None


def vision_architecture(config) -> str | None:
    return next((a for a in getattr(config, "architectures", None) or [] if a in VISION_ARCHITECTURES), None)


def vision_spec(config) -> VisionSpec | None:
    """The vision facts of a checkpoint's full config (AutoConfig), or None for a text-only model."""
    architecture = vision_architecture(config)
    if architecture is None:
        return None
    vision = config.vision_config
    if architecture in QWEN_TOWERS:
        wrap = (int(config.vision_start_token_id), int(config.vision_end_token_id))
        return VisionSpec(architecture, int(config.image_token_id), None, int(vision.spatial_merge_size), wrap)
    patches = (vision.image_size // vision.patch_size) ** 2
    full = config.vision_feature_select_strategy == "full"
    return VisionSpec(architecture, int(config.image_token_index), patches + int(full))


def checkpoint_vision_spec(model_path: str) -> VisionSpec | None:
    return vision_spec(AutoConfig.from_pretrained(model_path))


def text_config(config):
    """The config the decoder is built from: a vision-language checkpoint's text model, or the config itself."""
    architecture = vision_architecture(config)
    if architecture is None:
        return config
    text = config.text_config
    text_architecture = VISION_ARCHITECTURES[architecture]
    text.architectures = None if text_architecture is None else [text_architecture]
    if not hasattr(text, "tie_word_embeddings"):  # Qwen2-VL keeps it on the full config only
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def resolve_model_path(model_path: str | None) -> str:
    """"default" (or nothing) means the embedded SmolLM2 model, converted from its GGUF on first use; a path to a
    .gguf file (llama, qwen2, qwen3, gemma2, gemma3, phi3) is converted the same way."""
    if model_path in (None, "", "default"):
        from .default_model import prepare_default_model

        return str(prepare_default_model())
    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        from .default_model import prepare_user_gguf

        return str(prepare_user_gguf(model_path))
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path {model_path!r} is not a directory (furcate never downloads models)")
    return model_path


def load_config(model_path: str):
    """The decoder's config: the model's, or a vision-language model's text model's (vision.py)."""
    config = text_config(AutoConfig.from_pretrained(model_path))
    architecture = architecture_of(config)
    if architecture is None:
        raise ValueError(f"unsupported architecture {config.architectures or config.model_type!r}; "
                         f"furcate runs {sorted(FAMILIES)}")
    why_not = refusal(config)
    if why_not:
        raise ValueError(f"{architecture}: {why_not}")
    return config


def architecture_of(config) -> str | None:
    """The supported architecture a config names; configs without `architectures` fall back on model_type."""
    for name in getattr(config, "architectures", None) or []:
        if name in FAMILIES:
            return name
    return MODEL_TYPES.get(config.model_type) if not getattr(config, "architectures", None) else None


def check_tp_size(config, tp_size: int) -> None:
    """A clear error before any process starts when the model cannot be split tp_size ways."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    # MoE configs: each expert's (and Qwen2-MoE's shared expert's) intermediate size is split too.
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, field, None):
            sizes[field] = getattr(config, field)
    for field, size in sizes.items():
        if size % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide the model's {field} ({size})")
