"""Image embeddings for a forward, in the scheduler process: encode what is not cached, place it by rows.

An image is encoded only when a forward computes some of its tokens (a prefix the radix cache already holds
needs no encoding), and its embeddings are kept by hash, so the same image in several requests of a batch, or
in the next chunk of a long prompt, is encoded once. The images a forward misses are encoded in one call
(the encoder batches them as its model allows: LLaVA by size, Qwen2-VL all together, as HF encodes a prompt's).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from ..model.vision import load_vision_encoder
from ..model.weights.checkpoint import checkpoint_vision_spec
from ..wire.messages import ImagePiece

CACHED_IMAGES = 64


class ImageEmbedder:
    def __init__(self, encoder: nn.Module, device: str) -> None:
        self.encoder, self.device = encoder, torch.device(device)
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # digest -> [tokens, hidden], least recent first
        self.encoded_images = 0

    def embed(self, pieces: list[ImagePiece]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, values): the packed rows that show images, and their embeddings."""
        self._encode_missing(pieces)
        rows = torch.tensor([row for piece in pieces for row in piece.rows], dtype=torch.long, device=self.device)
        values = torch.cat([self.cache[p.image.digest][p.tokens.start : p.tokens.stop] for p in pieces])
        return rows, values

    def _encode_missing(self, pieces: list[ImagePiece]) -> None:
        missing = list({p.image.digest: p.image for p in pieces if p.image.digest not in self.cache}.values())
        if missing:
            for image, embeds in zip(missing, self.encoder.encode(missing)):
                if embeds.shape[0] != image.length:
                    raise ValueError(f"the encoder made {embeds.shape[0]} embeddings for an image of "
                                     f"{image.length} tokens")
                self.cache[image.digest] = embeds
            self.encoded_images += len(missing)
        for piece in pieces:
            self.cache.move_to_end(piece.image.digest)
        while len(self.cache) > max(CACHED_IMAGES, len({p.image.digest for p in pieces})):
            self.cache.popitem(last=False)


def image_embedder(model_path: str, dtype: torch.dtype, device: str, tp_size: int) -> ImageEmbedder | None:
    """A vision-language model's image encoder, on this (the only) rank; None for a text-only model."""
    if checkpoint_vision_spec(model_path) is None:
        return None
    if tp_size > 1:
        raise ValueError("vision-language models run with tp_size 1 (the image encoder is not split)")
    return ImageEmbedder(load_vision_encoder(model_path, dtype, device), device)
