"""The documentation's pages and their code blocks, as tests/test_docs.py runs them, and the site build (the
`docs_site` fixture of tests/conftest.py, which tests/test_docs.py and tests/test_docs_browser.py share).

Every ```python block of a docs/guides/ page runs, in page order and in one namespace (like a notebook), unless
the line before its fence is an HTML comment `<!-- not-run: why -->` (a server of its own, a GPU, a model that is
not the default one, a second process): those are compiled only. HTML comments do not render, so readers see
plain code blocks either way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*\S.*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # the fence's line number, for failure messages
    language: str
    code: str
    runs: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    """The page's fenced code blocks, each marked whether it runs."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening.group(1):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        language = opening.group(1)
        found.append(Block(page, i + 1, language, "\n".join(lines[i + 1:end]) + "\n",
                           language == "python" and not NOT_RUN.match(previous)))
        i = end + 1
    return found


def python_blocks(page: pathlib.Path) -> list[Block]:
    return [block for block in blocks(page) if block.language == "python"]


# Runs the blocks given as JSON on stdin in one namespace; a failure names the block's page and line.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for where, code in json.load(sys.stdin):
    print(f"--- {where}", flush=True)
    exec(compile(code, where, "exec"), namespace)
"""


def run_page(page: pathlib.Path, workdir: pathlib.Path, timeout: float) -> subprocess.CompletedProcess:
    """The page's runnable blocks in one fresh interpreter (cwd `workdir`, so files a page writes land there)."""
    payload = json.dumps([(block.where, block.code) for block in python_blocks(page) if block.runs])
    return subprocess.run([sys.executable, "-c", RUNNER], input=payload, capture_output=True, text=True,
                          cwd=workdir, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def build_site(destination: pathlib.Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the checkout into `destination` (the hook draws the benchmark plots first)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(destination)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
