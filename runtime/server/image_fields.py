"""Images in HTTP requests: what a remote client may point the server at.

A client sends images as data: URLs or base64 (read from the request itself), or http(s) URLs (fetched only when
the engine runs with allow_remote_images). A string that names a file on the server's machine is read only with
`--allow-local-images`: without it, a client could have the server open any path. The engine's image loader
does the rest (runtime/multimodal/images.py).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from .errors import ApiError

REQUEST_OWN = ("data:", "http://", "https://")


def checked_images(image_data: Any, allow_local: bool, depth: int = 0) -> Any:
    """image_data with every string a client may send; ApiError 400 for anything else. Lists nest two deep at
    most (a list per prompt, of its images)."""
    if isinstance(image_data, list):
        if depth == 2:
            raise ApiError(400, "image_data nests too deeply: an image, a list of images, or one list per prompt")
        return [checked_images(item, allow_local, depth + 1) for item in image_data]
    if image_data is None:
        return None
    if not isinstance(image_data, str):
        raise ApiError(400, f"an image must be a string (a data: URL, base64 or an http(s) URL), got "
                            f"{type(image_data).__name__}")
    if allow_local or image_data.startswith(REQUEST_OWN):
        return image_data
    return _base64_only(image_data)


def _base64_only(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "an image string must be a data: URL, base64 or an http(s) URL (paths on the "
                            "server's machine need --allow-local-images)") from None
