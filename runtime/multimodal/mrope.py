"""Qwen2-VL's M-RoPE positions: three axes (temporal, height, width) per token, as HF's get_rope_index lays out.

A text token has one position on all three axes, one past the previous token's; an image's tokens take their
place on the merged patch grid (t, h / merge, w / merge), offset by where the text before them ended, and the
text after an image goes on from that offset plus the grid's larger side. Every token after the prompt (decode,
or outputs recomputed after a retraction) sits at its index plus the prompt's delta (largest prompt position + 1
- prompt length) on all three axes, so it needs one position only. The positions of a token depend on the tokens
up to it alone, so a prefix the radix cache shares (same tokens, same images) has the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..wire.messages import ImageSpan


@dataclass(frozen=True)
class MRopePositions:
    prompt: torch.Tensor  # [3, prompt length], on the host
    delta: int

    def of(self, start: int, length: int) -> torch.Tensor:
        """Positions of tokens [start, start + length): [length] past the prompt (all axes equal), else [3, length]."""
        plain = torch.arange(start, start + length, device="cpu")
        prompt_length = self.prompt.shape[1]
        if start >= prompt_length:
            return plain + self.delta
        after = plain[prompt_length - start :] + self.delta
        return torch.cat([self.prompt[:, start : start + length], after.expand(3, -1)], dim=1)


def prompt_positions(prompt_length: int, images: list[ImageSpan]) -> MRopePositions:
    """The prompt's [3, length] positions and its delta; `images` in prompt order, each with its grid."""
    parts: list[torch.Tensor] = []
    position = text_start = 0
    for image in images:
        text = image.offset - text_start
        parts.append(torch.arange(position, position + text).expand(3, -1))
        position += text
        t, h, w = image.grid_thw[0], image.grid_thw[1] // image.merge_size, image.grid_thw[2] // image.merge_size
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack(grid).reshape(3, -1) + position)
        position += max(h, w)
        text_start = image.end
    parts.append(torch.arange(position, position + prompt_length - text_start).expand(3, -1))
    positions = torch.cat(parts, dim=1)
    return MRopePositions(positions, int(positions.max()) + 1 - prompt_length)
