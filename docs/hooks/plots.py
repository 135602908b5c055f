"""MkDocs hook: draws the benchmark plots from benchmarks/results/*.json into the site at every build.

The PNGs are never committed: each build draws them (`python -m benchmarks.plots`, from the repository root so
`benchmarks` imports) into a temporary folder and adds them to the site's files as benchmarks/plots/NAME.png, which
docs/benchmarks.md links, so `mkdocs build --strict` passes on a clean clone and the plots match the results.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[2]
SITE_FOLDER = "benchmarks/plots"
_drawn: list[pathlib.Path] = []  # temporary folders of this build, removed when it ends


def on_files(files: Files, config: MkDocsConfig) -> Files:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="furcate-plots-"))
    _drawn.append(folder)
    subprocess.run([sys.executable, "-m", "benchmarks.plots", "--out", str(folder)], cwd=ROOT, check=True,
                   capture_output=True)
    for png in sorted(folder.glob("*.png")):
        files.append(File.generated(config, f"{SITE_FOLDER}/{png.name}", abs_src_path=str(png)))
    return files


def on_post_build(config: MkDocsConfig) -> None:
    _remove_drawn()


def on_build_error(error: Exception) -> None:  # an aborted build leaves nothing behind either
    _remove_drawn()


def _remove_drawn() -> None:
    while _drawn:
        shutil.rmtree(_drawn.pop(), ignore_errors=True)
