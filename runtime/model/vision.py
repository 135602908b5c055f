"""Vision-language checkpoints: the text model inside them, and the image encoder beside it.

A LLaVA checkpoint (LlavaForConditionalGeneration) is a Llama text model, a CLIP vision tower and a two-layer
projector. The text model runs on furcate's decoder like any Llama (its weights renamed out of the
`language_model` prefix); the tower and projector are transformers' own modules, run as HF runs them
(hidden states of `vision_feature_layer`, the CLS token dropped under the "default" strategy), so an image's
embeddings are HF's to the bit. The layouts transformers has saved are all read (`model.vision_tower.*`,
`vision_tower.*`, 4.x's `vision_tower.vision_model.*`; `language_model.model.*` or `model.language_model.*`).

Qwen2-VL and Qwen2.5-VL are a Qwen2 text model with three-section rotary positions (M-RoPE, layers.py) and
transformers' own vision transformer (2-D rotary; 2.5 adds window attention), which takes an image as its
flattened patches and their grid and merges spatial_merge_size^2 patches into each token, so an image's token
count is its own. Their checkpoints are saved as `model.*` + `visual.*` or `model.language_model.*` +
`model.visual.*`.
"""

from __future__ import annotations

import glob
import importlib
import os
from collections.abc import Iterator

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModel

from ..wire.messages import ImageSpan
from .weights.checkpoint import QWEN_TOWERS, vision_architecture

# (checkpoint prefix, our prefix) of the vision tensors, newest layout first; every other tensor is the text
# model's, so these are tried first (`model.visual.*` would pass for a text tensor below).
VISION_PREFIXES = (("model.vision_tower.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
                   ("vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."),
                   ("multi_modal_projector.", "multi_modal_projector."),
                   ("model.visual.", "visual."), ("visual.", "visual."))
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."), ("model.", "model."))


def text_weight_name(name: str, multimodal: bool) -> str | None:
    """A checkpoint tensor's name for the decoder; None: not the text model's."""
    if not multimodal:
        return name
    if vision_weight_name(name) is not None:
        return None
    return next((ours + name[len(prefix):] for prefix, ours in TEXT_PREFIXES if name.startswith(prefix)), None)


def vision_weight_name(name: str) -> str | None:
    return next((ours + name[len(prefix):] for prefix, ours in VISION_PREFIXES if name.startswith(prefix)), None)


class LlavaEncoder(nn.Module):
    """pixel values [N, 3, H, W] -> image embeddings [N, tokens_per_image, text hidden size]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

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

    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden]; images of one size are encoded in one batch."""
        weight = next(self.parameters())
        by_shape: dict[tuple, list[int]] = {}
        for i, image in enumerate(images):
            by_shape.setdefault(np.shape(image.pixel_values), []).append(i)
        out: list[torch.Tensor] = [torch.empty(0)] * len(images)
        for indices in by_shape.values():
            pixels = torch.from_numpy(np.stack([images[i].pixel_values for i in indices]))
            for i, embeds in zip(indices, self(pixels.to(weight.device, weight.dtype))):
                out[i] = embeds
        return out


class QwenVisionEncoder(nn.Module):
    """Qwen2-VL's (or 2.5's) vision transformer, run as HF's get_image_features runs it: the images' patches
    [sum of patches, C * temporal * patch^2] and grids [N, 3] -> the merged tokens, split per image."""

    def __init__(self, config) -> None:
        super().__init__()
        self.visual = qwen_tower_class(vision_architecture(config))._from_config(config.vision_config)

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        weight = next(self.parameters())
        pixels = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
        grids = torch.tensor([image.grid_thw for image in images], dtype=torch.long, device=weight.device)
        merged = self.visual(pixels.to(weight.device, weight.dtype), grid_thw=grids).pooler_output
        return list(merged.split([image.length for image in images]))


def load_vision_encoder(model_path: str, dtype: torch.dtype, device: str) -> LlavaEncoder | QwenVisionEncoder:
    config = AutoConfig.from_pretrained(model_path)
    encoder_class = QwenVisionEncoder if vision_architecture(config) in QWEN_TOWERS else LlavaEncoder
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = encoder_class(config)
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


def qwen_tower_class(architecture: str) -> type[nn.Module]:
    """The transformers class of a Qwen-VL architecture's vision tower, its module imported now."""
    family, name = QWEN_TOWERS[architecture]
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
