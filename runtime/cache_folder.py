"""The folder furcate caches what it builds once per machine in: converted models, kernels, compiled graphs."""

from __future__ import annotations

import os
import pathlib


def furcate_cache() -> pathlib.Path:
    """$FURCATE_CACHE, or ~/.cache/furcate."""
    return pathlib.Path(os.environ.get("FURCATE_CACHE") or "~/.cache/furcate").expanduser()
