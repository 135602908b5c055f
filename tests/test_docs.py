"""The documentation site builds with `mkdocs build --strict` (no broken link, no missing API reference), every
Python block of the docs compiles, and every runnable block of each guide runs against the default model (the
marking: tests/docs_pages.py), so a guide cannot go stale. The README keeps its set-up and test commands first."""

from __future__ import annotations

import pathlib

import pytest

from docs_pages import DOCS, GUIDES, ROOT, python_blocks, run_page

PAGE_TIMEOUT = 180  # seconds for one guide's blocks; each starts at most one engine or server and generates little
ALL_PAGES = sorted(DOCS.rglob("*.md"))


def test_site_builds_strict(docs_site: pathlib.Path):
    for page in ("index.html", "guides/getting-started/index.html", "reference/index.html",
                 "benchmarks/plots/peers.png"):
        assert (docs_site / page).is_file(), page


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_python_blocks_compile(page: pathlib.Path):
    for block in python_blocks(page):
        compile(block.code, block.where, "exec")


@pytest.mark.parametrize("page", [p for p in GUIDES if any(b.runs for b in python_blocks(p))],
                         ids=lambda p: p.stem)
def test_guide_runs(page: pathlib.Path, tmp_path: pathlib.Path):
    ran = run_page(page, tmp_path, PAGE_TIMEOUT)
    assert ran.returncode == 0, f"{page.name}: the block after the last '---' line failed\n{ran.stdout}\n{ran.stderr}"


def test_readme_starts_with_the_two_commands():
    """.ci/run takes the test command from the README: the set-up and test commands stay first, and the README
    sends readers into docs/, never to a team-only folder."""
    readme = (ROOT / "README.md").read_text()
    first_fence = readme.index("```bash")
    assert readme.index("<!-- test-command") > first_fence
    assert readme.index("## ") > readme.index("<!-- test-command")
    assert "../shared" not in readme and "shared/" not in readme
    assert "docs/guides/getting-started.md" in readme
