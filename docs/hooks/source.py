"""MkDocs hook: the API reference documents this checkout's code, whatever the checkout's folder is called.

mkdocstrings finds `furcate` by searching folders for a package of that name, but the repository root is the
package itself (its folder is named after the clone), and the `mkdocs` console script puts its own folder first
on sys.path, where the `furcate` console script would pass for a module. So each build links a temporary
`furcate` to the root and searches there first.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority

ROOT = pathlib.Path(__file__).resolve().parents[2]
_linked: list[pathlib.Path] = []  # this build's temporary folders, removed when it ends


@event_priority(100)  # before mkdocstrings' own config event, which sets up its Python handler's search paths
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="furcate-source-"))
    (folder / "furcate").symlink_to(ROOT, target_is_directory=True)
    _linked.append(folder)
    # mkdocstrings' Python handler searches its `paths` (the root, which holds no `furcate`), then sys.path.
    sys.path.insert(0, str(folder))
    return config


def on_post_build(config: MkDocsConfig) -> None:
    _unlink()


def on_build_error(error: Exception) -> None:  # an aborted build leaves nothing behind either
    _unlink()


def _unlink() -> None:
    while _linked:
        folder = _linked.pop()
        if str(folder) in sys.path:
            sys.path.remove(str(folder))
        shutil.rmtree(folder, ignore_errors=True)
