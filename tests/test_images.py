"""Image loading: every accepted source gives the same digest for the same picture, and every bad input (wrong type,
corrupt or truncated data, a decompression bomb, limits, files, remote URLs) is a ValueError naming the problem."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import os
import socket
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from furcate.runtime.multimodal.images import ImageLimits, load_image, load_images, per_prompt_images

WIDTH, HEIGHT = 16, 12


def palette_picture(seed: int) -> Image.Image:
    """A P-mode picture: its RGB form is exact in every lossless format, GIF included."""
    rng = np.random.default_rng(seed)
    picture = Image.fromarray(rng.integers(0, 256, (HEIGHT, WIDTH), dtype=np.uint8)).convert("P")
    picture.putpalette(rng.integers(0, 256, 256 * 3, dtype=np.uint8).tobytes())
    return picture


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **params)
    return out.getvalue()


PALETTE = palette_picture(0)
RGB = PALETTE.convert("RGB")
PNG = encode(RGB, "PNG")
DIGEST = load_image(RGB).digest


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A valid-looking PNG of a few hundred bytes whose header claims width x height RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 256)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# --- every accepted source, the same digest ---------------------------------------------------------------------


def same_picture_sources(tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "picture.png"
    path.write_bytes(PNG)
    b64 = base64.b64encode(PNG).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    return {
        "png bytes": PNG,
        "bmp bytes": encode(RGB, "BMP"),
        "gif bytes": encode(PALETTE, "GIF"),
        "lossless webp": encode(RGB, "WEBP", lossless=True),
        "tiff": encode(RGB, "TIFF"),
        "bytearray": bytearray(PNG),
        "memoryview": memoryview(PNG),
        "Path": path,
        "str path": str(path),
        "base64": b64,
        "wrapped base64": wrapped,
        "data URL": "data:image/png;base64," + b64,
        "PIL RGB": RGB,
        "PIL RGBA": RGB.convert("RGBA"),
        "PIL P": PALETTE,
        "PNG of P": encode(PALETTE, "PNG"),
        "animated GIF, first frame": encode(PALETTE, "GIF", save_all=True, append_images=[palette_picture(1)]),
    }


def test_every_source_of_one_picture_hashes_alike(tmp_path: Path) -> None:
    for name, source in same_picture_sources(tmp_path).items():
        loaded = load_image(source)
        assert loaded.image.mode == "RGB" and loaded.image.size == (WIDTH, HEIGHT), name
        assert loaded.digest == DIGEST, name


def test_different_pictures_of_one_size_differ() -> None:
    other = RGB.copy()
    other.putpixel((3, 4), tuple((v + 1) % 256 for v in RGB.getpixel((3, 4))))
    assert load_image(other).digest != DIGEST
    assert load_image(palette_picture(1).convert("RGB")).digest != DIGEST


def test_same_bytes_in_a_different_shape_differ() -> None:
    pixels = np.asarray(RGB).reshape(-1, 3)
    reshaped = Image.fromarray(pixels.reshape(WIDTH, HEIGHT, 3))
    assert reshaped.tobytes() == RGB.tobytes()
    assert load_image(reshaped).digest != DIGEST


def test_the_loaded_image_is_a_copy() -> None:
    mine = RGB.copy()
    loaded = load_image(mine)
    mine.putpixel((0, 0), (1, 2, 3))
    assert load_image(loaded.image).digest == DIGEST


def test_transparency_is_composited_over_white() -> None:
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)  # black, fully transparent
    rgba[0, 0] = (10, 20, 30, 255)
    loaded = load_image(encode(Image.fromarray(rgba), "PNG")).image
    assert loaded.getpixel((0, 0)) == (10, 20, 30)
    assert loaded.getpixel((1, 1)) == (255, 255, 255)
    la = Image.fromarray(np.array([[[40, 255], [40, 0]]], dtype=np.uint8))
    assert la.mode == "LA"
    loaded = load_image(la).image
    assert [loaded.getpixel((0, 0)), loaded.getpixel((1, 0))] == [(40, 40, 40), (255, 255, 255)]


def test_sixteen_bit_grayscale_is_scaled_not_clipped() -> None:
    levels = np.arange(0, 256, dtype=np.uint16).reshape(16, 16)
    gray16 = Image.fromarray(levels * 257)
    assert gray16.mode == "I;16"
    expected = load_image(Image.fromarray(levels.astype(np.uint8)))
    assert load_image(encode(gray16, "PNG")).digest == expected.digest
    assert load_image(gray16).digest == expected.digest


def test_cmyk_and_jpeg_load_as_rgb() -> None:
    cmyk = RGB.convert("CMYK")
    assert load_image(encode(cmyk, "JPEG")).image.mode == "RGB"
    assert load_image(cmyk).digest == load_image(cmyk.convert("RGB")).digest
    assert load_image(encode(RGB, "JPEG")).image.size == (WIDTH, HEIGHT)


# --- bad input --------------------------------------------------------------------------------------------------


def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a picture\n")
    return path


BAD = [
    pytest.param({}, ImageLimits(), "dict", id="dict"),
    pytest.param(3, ImageLimits(), "int", id="int"),
    pytest.param(True, ImageLimits(), "bool", id="bool"),
    pytest.param([PNG], ImageLimits(), "list", id="list"),
    pytest.param(None, ImageLimits(), "NoneType", id="None"),
    pytest.param(b"", ImageLimits(), "empty", id="empty bytes"),
    pytest.param("", ImageLimits(), "empty", id="empty str"),
    pytest.param(" \n ", ImageLimits(), "empty", id="blank str"),
    pytest.param("abc\ud800", ImageLimits(), "surrogate", id="lone surrogate"),
    pytest.param("hello world", ImageLimits(), "base64", id="not base64"),
    pytest.param("aGVsbG8gd29ybGQ=", ImageLimits(), "not an image", id="base64 of text"),
    pytest.param("data:image/png;base64,!!!!", ImageLimits(), "base64", id="data URL, bad base64"),
    pytest.param("data:image/png;base64,", ImageLimits(), "no base64 data", id="data URL, no data"),
    pytest.param("data:text/plain;base64,aGk=", ImageLimits(), "data:image", id="data URL, not an image type"),
    pytest.param("data:image/png,%89PNG", ImageLimits(), "base64", id="data URL, not base64"),
    pytest.param(b"\x00corrupt\xff" * 10, ImageLimits(), "not an image", id="corrupt bytes"),
    pytest.param(PNG[: len(PNG) // 2], ImageLimits(), "truncated", id="truncated PNG"),
    pytest.param(PNG[:20], ImageLimits(), "not a readable image", id="PNG header cut short"),
    pytest.param(encode(RGB, "JPEG")[:400], ImageLimits(), "readable", id="truncated JPEG"),
    pytest.param(encode(RGB, "TGA"), ImageLimits(), "supported format", id="format not allowed"),
    pytest.param(PNG, ImageLimits(max_pixels=WIDTH * HEIGHT - 1), "pixels", id="over max_pixels"),
    pytest.param(RGB, ImageLimits(max_pixels=100), "pixels", id="PIL image over max_pixels"),
    pytest.param(PNG, ImageLimits(max_bytes=len(PNG) - 1), "max_bytes", id="bytes over max_bytes"),
    pytest.param(base64.b64encode(PNG).decode(), ImageLimits(max_bytes=64), "max_bytes", id="base64 over max_bytes"),
    pytest.param(png_header_only(31623, 31623), ImageLimits(), "pixels", id="bomb, 10^9 pixels"),
    pytest.param(png_header_only(5000, 5000), ImageLimits(), "max_pixels", id="under PIL's limit, over ours"),
    pytest.param(Path("/nonexistent/picture.png"), ImageLimits(), "no such", id="missing Path"),
    pytest.param("/nonexistent/picture.png", ImageLimits(), "no such file", id="missing str path"),
    pytest.param(Path("/tmp"), ImageLimits(), "directory", id="directory"),
    pytest.param("/tmp", ImageLimits(), "directory", id="directory as str"),
    pytest.param(Path("/tmp/x.png"), ImageLimits(allow_local_files=False), "local", id="local files off"),
    pytest.param("/tmp", ImageLimits(allow_local_files=False), "allow_local_files", id="str path, local files off"),
    pytest.param("/nonexistent/picture", ImageLimits(), "no such file", id="missing path that is base64 too"),
    pytest.param("http://127.0.0.1:1/x.png", ImageLimits(), "allow_remote_images", id="remote off"),
    pytest.param("HTTPS://example.com/x.png", ImageLimits(), "allow_remote_images", id="remote off, upper case"),
]


@pytest.mark.parametrize("item, limits, word", BAD)
def test_bad_input_is_a_value_error_naming_the_problem(item: object, limits: ImageLimits, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        load_image(item, limits)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an image"):
        load_image(text_file(tmp_path))
    with pytest.raises(ValueError, match="max_bytes"):
        (tmp_path / "big.png").write_bytes(PNG)
        load_image(str(tmp_path / "big.png"), ImageLimits(max_bytes=100))
    with pytest.raises(ValueError, match="local"):
        load_image(str(tmp_path / "big.png"), ImageLimits(allow_local_files=False))
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_image(tmp_path / "empty.png")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    with pytest.raises(ValueError, match="regular file"):
        load_image(fifo)


def test_a_bomb_warns_nothing_and_leaves_pil_alone() -> None:
    before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Between PIL's warning threshold and its error threshold: PIL would warn, our limit refuses.
        with pytest.raises(ValueError, match="pixels"):
            load_image(png_header_only(10000, 10000))
        with pytest.raises(ValueError, match="pixels"):
            load_image(png_header_only(31623, 31623))
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == before


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("item", ["~" * 10_000, {"k" * 1000: ["v" * 1000] * 1000}, Unprintable()])
def test_messages_cut_long_values(item: object) -> None:
    with pytest.raises(ValueError) as error:
        load_image(item)
    assert len(str(error.value)) < 400


def test_load_images_checks_the_count_first() -> None:
    assert [loaded.digest for loaded in load_images([PNG, RGB])] == [DIGEST, DIGEST]
    with pytest.raises(ValueError, match="too many"):
        load_images([object()] * 3, ImageLimits(max_images=2))  # would fail on type if loaded
    with pytest.raises(ValueError, match="image 1"):
        load_images([PNG, b"junk"])
    with pytest.raises(ValueError, match="list"):
        load_images(PNG)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "limits",
    [{"max_pixels": 0}, {"max_bytes": -1}, {"max_images": 1.5}, {"remote_timeout_s": 0}, {"max_pixels": True}],
)
def test_bad_limits(limits: dict) -> None:
    with pytest.raises(ValueError, match="ImageLimits"):
        ImageLimits(**limits)


# --- remote -----------------------------------------------------------------------------------------------------

BIG = 4096


class Handler(http.server.BaseHTTPRequestHandler):
    routes = {"/picture.png", "/text", "/big-declared", "/big-streamed", "/slow", "/drip"}

    def do_GET(self) -> None:
        with contextlib.suppress(OSError):  # the client may have given up first
            if self.path not in self.routes:
                self.send_error(404)
                return
            if self.path == "/slow":
                time.sleep(1.0)
            body = {"/picture.png": PNG, "/text": b"hello"}.get(self.path, b"\x00" * (BIG * 2))
            self.send_response(200)
            if self.path != "/big-streamed" and self.path != "/drip":
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.path == "/drip":
                for _ in range(30):
                    self.wfile.write(b"\x00")
                    self.wfile.flush()
                    time.sleep(0.05)
                return
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy in the environment (package registries come through one) must not be asked for 127.0.0.1."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "*")


REMOTE = ImageLimits(allow_remote=True, max_bytes=BIG, remote_timeout_s=0.3)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_remote_images(server: str, no_proxy: None) -> None:
    assert load_image(f"{server}/picture.png", REMOTE).digest == DIGEST
    with pytest.raises(ValueError, match="allow_remote_images"):
        load_image(f"{server}/picture.png")
    for path, word in [
        ("/missing", "404"),
        ("/text", "not an image"),
        ("/big-declared", "max_bytes"),
        ("/big-streamed", "max_bytes"),
        ("/slow", "remote_timeout_s"),
        ("/drip", "remote_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=word):
            load_image(server + path, REMOTE)
    with pytest.raises(ValueError, match="cannot fetch"):
        load_image(f"http://127.0.0.1:{closed_port()}/x.png", REMOTE)
    with pytest.raises(ValueError, match="cannot fetch"):
        load_image("http://[::1/x.png", REMOTE)


# --- per_prompt_images ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image_data, num_prompts, expected",
    [
        (None, 3, [[], [], []]),
        ([], 2, [[], []]),
        ("a", 1, [["a"]]),
        ("a", 2, [["a"], ["a"]]),  # SGLang gives a single image to every prompt
        (["a", "b"], 1, [["a", "b"]]),
        ([["a", "b"]], 1, [["a", "b"]]),
        ([None], 1, [[]]),
        (("a", "b"), 1, [["a", "b"]]),
        (["a", "b"], 2, [["a"], ["b"]]),
        (["a", ["b", "c"], None], 3, [["a"], ["b", "c"], []]),
        ([["a"], [None], []], 3, [["a"], [], []]),
        ([PNG, {"url": "x"}], 2, [[PNG], [{"url": "x"}]]),  # items are not checked here
    ],
)
def test_per_prompt_images(image_data: object, num_prompts: int, expected: list) -> None:
    assert per_prompt_images(image_data, num_prompts) == expected


def test_per_prompt_lists_are_distinct() -> None:
    lists = per_prompt_images(None, 2)
    lists[0].append("a")
    assert lists[1] == []


@pytest.mark.parametrize(
    "image_data, num_prompts, word",
    [
        (["a", "b"], 3, "one entry per prompt"),
        ([["a"], ["b"]], 1, "one entry per prompt"),
        (["a", ["b"]], 1, "one entry per prompt"),
        ([["a", ["b"]]], 1, "nested"),
        ([["a", None], ["b"]], 2, "None"),
        ("a", 0, "num_prompts"),
        ("a", True, "num_prompts"),
    ],
)
def test_per_prompt_images_bad_shapes(image_data: object, num_prompts: int, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        per_prompt_images(image_data, num_prompts)


# --- fuzz -------------------------------------------------------------------------------------------------------

SMALL = ImageLimits(max_pixels=256 * 256, max_bytes=1 << 16, allow_local_files=False)
SEEDS = [PNG, encode(RGB, "BMP"), encode(PALETTE, "GIF"), encode(RGB, "JPEG"), encode(RGB, "TIFF"), encode(RGB, "WEBP")]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def loads_or_refuses(item: object, limits: ImageLimits = SMALL) -> None:
    try:
        loaded = load_image(item, limits)
    except ValueError:
        return
    assert loaded.image.mode == "RGB"


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    loads_or_refuses(data)


@FUZZ
@given(st.text(st.characters(exclude_categories=()), max_size=300))  # surrogates included
def test_random_text(text: str) -> None:
    loads_or_refuses(text)
    loads_or_refuses("data:image/png;base64," + text)


@FUZZ
@given(
    st.sampled_from(SEEDS),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
    st.integers(0, 10**6),
)
def test_mutated_images(seed: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(seed)
    for position, value in edits:
        data[position % len(data)] = value
    loads_or_refuses(bytes(data[: max(1, len(data) - cut % len(data))]))
