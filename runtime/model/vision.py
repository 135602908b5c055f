"""Vision-language checkpoints: the text model inside them, and the image encoder beside it.

A LLaVA checkpoint (LlavaForConditionalGeneration) is a Llama text model, a CLIP vision tower and a two-layer
projector. The text model runs on furcate's decoder like any Llama (its weights renamed out of the
`language_model` prefix); the tower and projector are transformers' own modules, run as HF runs them
(hidden states of `vision_feature_layer`, the CLS token dropped under the "default" strategy), so an image's
embeddings are HF's to the bit. The layouts transformers has saved are all read (`model.vision_tower.*`,
`vision_tower.*`, 4.x's `vision_tower.vision_model.*`; `language_model.model.*` or `model.language_model.*`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
# (checkpoint prefix, our prefix) for the text model's tensors, newest layout first.
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
VISION_PREFIXES = (("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
                   ("vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."),
                   ("multi_modal_projector.", "multi_modal_projector."))


@dataclass(frozen=True)
class VisionSpec:
    """What the rest of furcate needs to know of a vision-language model."""

    architecture: str
    image_token_id: int  # the placeholder token of one image position in the prompt
    tokens_per_image: int  # LLaVA: fixed, (image_size / patch_size)^2 (+1 with the CLS token kept)


def vision_architecture(config) -> str | None:
    return next((a for a in getattr(config, "architectures", None) or [] if a in VISION_ARCHITECTURES), None)


def vision_spec(config) -> VisionSpec | None:
    """The vision facts of a checkpoint's full config (AutoConfig), or None for a text-only model."""
    architecture = vision_architecture(config)
    if architecture is None:
        return None
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    full = config.vision_feature_select_strategy == "full"
    return VisionSpec(architecture, int(config.image_token_index), patches + int(full))


def checkpoint_vision_spec(model_path: str) -> VisionSpec | None:
    return vision_spec(AutoConfig.from_pretrained(model_path))


def text_config(config):
    """The config the decoder is built from: a vision-language checkpoint's text model, or the config itself."""
    if vision_architecture(config) is None:
        return config
    text = config.text_config
    text.architectures = None  # found by model_type ("llama")
    return text


def text_weight_name(name: str, multimodal: bool) -> str | None:
    """A checkpoint tensor's name for the decoder; None: not the text model's."""
    if not multimodal:
        return name
    for prefix, ours in TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None


def vision_weight_name(name: str) -> str | None:
    for prefix, ours in VISION_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None


class LlavaEncoder(nn.Module):
    """pixel values [N, 3, H, W] -> image embeddings [N, tokens_per_image, text hidden size]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        if not isinstance(self.feature_layer, int):
            raise ValueError("LLaVA checkpoints with several vision_feature_layer are not supported")

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states
        selected = states[self.feature_layer]
        if self.strategy == "default":
            selected = selected[:, 1:]
        return self.multi_modal_projector(selected)


def load_vision_encoder(model_path: str, dtype: torch.dtype, device: str) -> LlavaEncoder:
    config = AutoConfig.from_pretrained(model_path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = LlavaEncoder(config)
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = encoder.load_state_dict(dict(_vision_tensors(model_path)), strict=False)
    missing = [name for name in missing if "position_ids" not in name]  # a buffer, not a weight
    if missing or unexpected:
        raise ValueError(f"the vision weights in {model_path} do not fit {config.architectures[0]}: missing "
                         f"{missing[:4]}, unexpected {unexpected[:4]}")
    return encoder.eval()


def _vision_tensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                ours = vision_weight_name(name)
                if ours is not None:
                    yield ours, handle.get_tensor(name)
