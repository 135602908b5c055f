"""Engine side of images: a prompt's image placeholders become the image's tokens, and its pixels are processed.

Each placeholder token (LLaVA's `<image>`) stands for one image, in order; it is expanded to the model's tokens
per image, each holding a pad id past the vocabulary derived from the image's hash (as SGLang pads them): the
radix cache then shares a prefix that shows the same image and never one that shows another, and the model
takes those rows' embeddings from the image encoder. A prompt given already expanded (runs of the placeholder,
one run per image) is taken as it is. LLaVA's images take a fixed number of tokens; Qwen2-VL's each take their own,
their patch grid (from the image processor) over the merged patches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from transformers import AutoImageProcessor

from ..model.weights.checkpoint import VisionSpec
from ..wire.messages import ImageSpan
from .images import ImageLimits, LoadedImage, load_images

PAD_RANGE = 2**30  # pad ids are vocab_size + (hash mod this): int64-safe, distinct per image in practice


class ImagePrompts:
    def __init__(self, model_path: str, spec: VisionSpec, vocab_size: int, limits: ImageLimits) -> None:
        self.spec, self.vocab_size, self.limits = spec, vocab_size, limits
        self.processor = AutoImageProcessor.from_pretrained(model_path)

    def expand(self, ids: list[int], items: list[Any]) -> tuple[list[int], list[ImageSpan]]:
        """The prompt with its images' tokens, and the images; ValueError when they do not match."""
        shown = [self.span(image) for image in load_images(items, self.limits)]
        places = self.placeholders(ids, [image.length for image in shown])
        out: list[int] = []
        spans: list[ImageSpan] = []
        previous = 0
        for (start, length), image in zip(places, shown):
            out += ids[previous:start]
            spans.append(dataclasses.replace(image, offset=len(out)))
            out += [image.pad_id] * image.length
            previous = start + length
        return out + ids[previous:], spans

    def placeholders(self, ids: list[int], lengths: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each image's placeholder: one token per image, or a whole run per image."""
        token = self.spec.image_token_id
        singles = [(i, 1) for i, t in enumerate(ids) if t == token]
        if len(singles) == len(lengths):
            return singles
        runs = placeholder_runs(ids, token)
        if [length for _, length in runs] == lengths:
            return runs
        raise ValueError(f"the prompt has {len(singles)} image placeholder token(s) for {len(lengths)} image(s); "
                         "put one placeholder per image where it belongs")

    def span(self, image: LoadedImage) -> ImageSpan:
        """The image's span, at offset 0 until it is placed; its token count is the processed image's."""
        processed = self.processor(images=[image.image], return_tensors="np")
        pad = self.vocab_size + int(image.digest[:16], 16) % PAD_RANGE
        if "image_grid_thw" not in processed:  # LLaVA: one [3, H, W] image, a fixed number of tokens
            return ImageSpan(image.digest, 0, self.spec.tokens_per_image, pad, self.spec.image_token_id,
                             np.ascontiguousarray(processed["pixel_values"][0], dtype=np.float32))
        grid = tuple(int(n) for n in processed["image_grid_thw"][0])  # the pixel values are this one's patches
        return ImageSpan(image.digest, 0, math.prod(grid) // self.spec.merge_size**2, pad, self.spec.image_token_id,
                         np.ascontiguousarray(processed["pixel_values"], dtype=np.float32), grid,
                         self.spec.merge_size)


def placeholder_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token`, in order."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
