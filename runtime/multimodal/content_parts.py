"""Chat messages in the form a vision-language model's chat template reads: content as a list of parts,
`{"type": "text", "text": ...}` and `{"type": "image"}`, as HF's processors pass them to `apply_chat_template`.

Templates written for such models show an image part their own way (LLaVA's `<image>\\n`, before the message's
text; Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>` where it stands), so a prompt equals HF's only when
its messages reach the template as parts. Templates written for plain strings fail on a list, or print its repr.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PROBE_TEXT = "\u2063furcate-probe\u2063"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_part(source: Any = None) -> dict[str, Any]:
    """An image part; with its source (a path, URL, bytes or PIL image) where a caller may want to load it."""
    return {"type": "image"} if source is None else {"type": "image", "image": source}


def as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's content as parts: a string becomes one text part."""
    return [text_part(content)] if isinstance(content, str) else content


def shows_image_parts(render: Callable[[list[dict[str, Any]]], str], placeholder: str) -> bool:
    """Whether a template (`render`: messages -> its text) shows content parts: a user message of an image and a
    text renders both, the image as something holding the model's placeholder."""
    try:
        text = render([{"role": "user", "content": [image_part(), text_part(PROBE_TEXT)]}])
    except Exception:  # noqa: BLE001 - a template for strings raises anything on a list
        return False
    return PROBE_TEXT in text and placeholder in text
