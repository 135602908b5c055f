"""The built docs site renders in headless Chromium: the home page, a guide and the benchmarks page load with no
console error and no missing file, and show their headings and (on the benchmarks page) the plots.

The site is served over HTTP from a local thread (file:// would make the search index's fetch fail), and the
server records every request, so a page that links a file the build did not write fails here even when the
browser shows nothing. Skips, saying why, where Chromium is not installed (.ci/run installs the Debian package).
"""

from __future__ import annotations

import functools
import http.server
import pathlib
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
# Chromium logs every console message of a page, whatever its level, as INFO:CONSOLE (an uncaught exception
# included, as "Uncaught ..."); the site's pages log nothing, so any console line is a failure. Chromium's own
# start-up noise on a headless machine (D-Bus, no GPU) carries other markers.
PAGE_CONSOLE = re.compile(r":CONSOLE[:(]|Uncaught")
PAGES = {
    "": ["furcate", "Learn", "Look up"],
    "guides/programs/": ["Writing programs", "Fork and join", "Errors"],
    "benchmarks/": ["Benchmarks", "furcate against its peers on a CPU", "Speculative decoding"],
}


class RecordingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site and records (status, path) of every request, quietly."""

    requests: list[tuple[int, str]]

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.requests.append((int(code) if str(code).isdigit() else 0, self.path))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's signature
        pass


@pytest.fixture(scope="module")
def site(docs_site: pathlib.Path) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    requests: list[tuple[int, str]] = []
    handler = type("Handler", (RecordingHandler,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(docs_site)))
    threading.Thread(target=server.serve_forever, daemon=True, name="docs-http").start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", requests
    finally:
        server.shutdown()
        server.server_close()


def chromium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("page", list(PAGES), ids=lambda p: p or "home")
def test_page_renders(page: str, site: tuple[str, list[tuple[int, str]]], tmp_path: pathlib.Path):
    base, requests = site
    shot = tmp_path / "page.png"
    requests.clear()
    rendered = chromium(f"--screenshot={shot}", "--window-size=1280,1600", "--virtual-time-budget=5000",
                        base + page)
    assert shot.is_file() and shot.stat().st_size > 10_000, rendered.stderr[-2000:]
    errors = [line for line in rendered.stderr.splitlines() if PAGE_CONSOLE.search(line)]
    assert not errors, "\n".join(errors)
    missing = [path for status, path in requests if status >= 400]
    assert not missing, f"the page asked for files the site lacks: {missing}"
    dom = chromium("--dump-dom", "--virtual-time-budget=5000", base + page).stdout
    headings = re.sub(r"<[^>]+>", "", " ".join(re.findall(r"<h[12][^>]*>.*?</h[12]>", dom, re.S)))
    for heading in PAGES[page]:
        assert heading in headings, f"{heading!r} not among the headings of {page or 'home'}: {headings[:500]}"
    if page == "benchmarks/":
        plots = set(re.findall(r'<img[^>]+src="([^"]+\.png)"', dom))
        assert len(plots) >= 5, plots
        fetched = {path for status, path in requests if status == 200 and path.endswith(".png")}
        assert len(fetched) >= 5, f"the browser fetched {fetched}"
