"""Images as a remote server takes them: strings of the request itself (a data: URL or base64), never a path on
the client's machine, which the server cannot read."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from typing import Any

REMOTE_FORMS = ("data:", "http://", "https://")


def wire_image(source: Any) -> str:
    """A data: or http(s) URL as it is, a local file's or bytes' contents as base64, a PIL image as PNG base64."""
    if isinstance(source, str):
        if source.startswith(REMOTE_FORMS) or not os.path.isfile(source):
            return source  # a URL, or base64 (the server says what is wrong with anything else)
        with open(source, "rb") as handle:
            source = handle.read()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(source)).decode("ascii")
    if hasattr(source, "save"):  # a PIL image
        encoded = io.BytesIO()
        source.save(encoded, format="PNG")
        return base64.b64encode(encoded.getvalue()).decode("ascii")
    raise ValueError(f"an image must be a path, URL, base64 string, bytes or a PIL image, got "
                     f"{type(source).__name__}")


def wire_images(images: Sequence[Any]) -> list[str] | None:
    return [wire_image(image) for image in images] if images else None
