"""Turn whatever a user passes as an image into a fully decoded RGB PIL image with a content hash.

A request's image can be a PIL image, encoded bytes, a local path, a ``data:image/...;base64,`` URL, an http(s) URL
(only when remote images are on) or a bare base64 string. Each is read under ``ImageLimits`` (encoded bytes, decoded
pixels, images per request) and any failure is a ``ValueError`` naming the problem, so a bad image fails that
request and nothing else. The digest covers the decoded pixels, not the encoding, so the same picture sent as PNG,
BMP or base64 maps to the same cache entry.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import os
import reprlib
import stat
import struct
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

# Decoders we let untrusted bytes reach. Pillow can open dozens of formats; the rare ones are where decoder bugs
# live, and EPS would run Ghostscript on load. Models are fed photos and screenshots, which these cover.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "AVIF")

# Filesystem paths are never longer than this; a longer str is base64, and stat-ing megabytes of it is waste.
_MAX_PATH_CHARS = 4096
_READ_CHUNK = 64 * 1024
_SHOWN_CHARS = 60
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_SHORT_REPR = reprlib.Repr()  # keyword arguments to Repr need Python 3.12
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 2, _SHOWN_CHARS, _SHOWN_CHARS


class _OverLimit(ValueError):
    """A limit refused the input; passed through unchanged by handlers that reword other ValueErrors."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may cost; every check in this module reads its bound from here."""

    max_pixels: int = 4096 * 4096  # decoded width*height allowed per image
    max_bytes: int = 32 * 2**20  # encoded size allowed per image (file, bytes, base64, download)
    max_images: int = 16  # per request
    allow_local_files: bool = True  # str paths to files on this machine
    allow_remote: bool = False  # http(s) URLs; off by default: a server must not fetch arbitrary addresses
    remote_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_bytes", "max_images"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive int, got {value!r}")
        timeout = self.remote_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"ImageLimits.remote_timeout_s must be a positive number of seconds, got {timeout!r}")


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image and the hash of its pixels."""

    image: Image.Image  # RGB, fully decoded
    digest: str  # hex sha256 over (width, height, RGB pixel bytes)


def load_image(item: object, limits: ImageLimits = ImageLimits()) -> LoadedImage:
    """Decode one image from any accepted source; a ValueError names the problem for anything else."""
    if isinstance(item, Image.Image):
        return _finish(item, limits, "the PIL image")
    if isinstance(item, bytes | bytearray | memoryview):
        size = item.nbytes if isinstance(item, memoryview) else len(item)
        if size > limits.max_bytes:  # before bytes() copies it
            raise ValueError(f"image data is {size} bytes, over {limits.max_bytes} (max_bytes)")
        return _decode(_checked_bytes(bytes(item), limits, "image data"), limits, "image data")
    if isinstance(item, os.PathLike):
        path = os.fspath(item)
        if not isinstance(path, str):
            raise ValueError(f"an image path must be text, got bytes path {_show(path)}")
        return _load_file(path, limits)
    if isinstance(item, str):
        return _load_str(item, limits)
    raise ValueError(
        f"an image must be a PIL image, encoded bytes, a file path, a data URL, an http(s) URL or base64 text; "
        f"got {type(item).__name__} {_show(item)}"
    )


def load_images(items: list[object], limits: ImageLimits = ImageLimits()) -> list[LoadedImage]:
    """Load one request's images; the count is checked before any is read, and a failure names the image's index."""
    if not isinstance(items, list | tuple):
        raise ValueError(f"images must be a list of images, got {type(items).__name__} {_show(items)}")
    if len(items) > limits.max_images:
        raise ValueError(f"too many images: {len(items)} given, at most {limits.max_images} per request (max_images)")
    loaded = []
    for index, item in enumerate(items):
        try:
            loaded.append(load_image(item, limits))
        except ValueError as exc:
            raise ValueError(f"image {index}: {exc}") from exc
    return loaded


def per_prompt_images(image_data: object, num_prompts: int) -> list[list[object]]:
    """Normalize SGLang's ``image_data`` shapes to one list of items per prompt, without loading anything.

    None or [] is no images; a single item (not a list) goes with every prompt, as in SGLang. For one prompt a list
    is that prompt's items (or ``[entry]`` in the per-prompt form); for several prompts a list has one entry per
    prompt, each an item, a list of items, or None.
    """
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be a positive int, got {num_prompts!r}")
    if image_data is None:
        return [[] for _ in range(num_prompts)]
    if not _is_sequence(image_data):
        return [[image_data] for _ in range(num_prompts)]
    entries = list(image_data)  # type: ignore[call-overload]
    if not entries:
        return [[] for _ in range(num_prompts)]
    if num_prompts == 1 and all(_is_item(entry) for entry in entries):
        return [entries]
    if len(entries) != num_prompts:
        raise ValueError(
            f"image_data has {len(entries)} entries for {num_prompts} prompt(s); expected one entry per prompt "
            f"(an image, a list of images, or None), or for a single prompt a flat list of images"
        )
    return [_prompt_items(entry, index) for index, entry in enumerate(entries)]


def _prompt_items(entry: object, index: int) -> list[object]:
    if entry is None:
        return []
    if not _is_sequence(entry):
        return [entry]
    items = list(entry)  # type: ignore[call-overload]
    if items == [None]:  # SGLang's spelling of "no image for this prompt"
        return []
    for item in items:
        if not _is_item(item):
            raise ValueError(
                f"image_data[{index}] holds {'None' if item is None else 'a nested list'}; expected each prompt's "
                f"entry to be an image, a flat list of images, or None"
            )
    return items


def _is_sequence(value: object) -> bool:
    return isinstance(value, list | tuple)


def _is_item(value: object) -> bool:
    return value is not None and not _is_sequence(value)


def _load_str(text: str, limits: ImageLimits) -> LoadedImage:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"image text is not valid UTF-8 (lone surrogates): {_show(text)}") from exc
    stripped = text.strip()
    if not stripped:
        raise ValueError("image text is empty")
    head = stripped[:8].lower()
    if head.startswith("data:"):
        return _load_data_url(stripped, limits)
    if head.startswith(("http://", "https://")):
        return _load_url(stripped, limits)
    if limits.allow_local_files and len(text) <= _MAX_PATH_CHARS and os.path.lexists(text):
        return _load_file(text, limits)
    try:
        data = _b64decode(stripped, limits, "base64 text")
    except _OverLimit:
        raise
    except ValueError as exc:
        raise ValueError(_not_a_source(text, limits, exc)) from exc
    try:
        return _decode(data, limits, "base64 text")
    except ValueError as exc:
        # "/tmp/cat" is valid base64 too: short path-like text that decoded to no image was most likely a path.
        if not _looks_like_path(text):
            raise
        raise ValueError(_not_a_source(text, limits, exc)) from exc


def _looks_like_path(text: str) -> bool:
    return len(text) <= _MAX_PATH_CHARS and ("/" in text or "\\" in text or text.startswith(("~", ".")))


def _not_a_source(text: str, limits: ImageLimits, reason: ValueError) -> str:
    """Say what a str failed to be, pointing at files when the user seems to have meant a path."""
    expected = "expected a data:image/...;base64 URL, an http(s) URL, a path to an image file, or base64 image bytes"
    if _looks_like_path(text) and not limits.allow_local_files:
        return (
            f"{_show(text)} is not a base64 image ({reason}), and local image files are off "
            f"(ImageLimits.allow_local_files); {expected}"
        )
    if _looks_like_path(text):
        return f"no such file {_show(text)}, nor is it a base64 image ({reason}); {expected}"
    return f"{_show(text)} is not an image source ({reason}); {expected}"


def _load_data_url(url: str, limits: ImageLimits) -> LoadedImage:
    header, comma, payload = url.partition(",")
    params = header[len("data:") :].lower().split(";")
    if not comma or not params[0].startswith("image/") or params[-1] != "base64":
        raise ValueError(f"a data URL must look like data:image/<type>;base64,<data>; got {_show(url)}")
    return _decode(_b64decode(payload, limits, "the data URL"), limits, "the data URL")


def _b64decode(text: str, limits: ImageLimits, source: str) -> bytes:
    compact = "".join(text.split())  # base64 is often wrapped at 76 columns
    if not compact:
        raise ValueError(f"{source} has no base64 data")
    # Refuse before decoding: decoding a huge string only to throw it away costs memory the limit is there to save.
    if len(compact) // 4 * 3 > limits.max_bytes + 3:
        raise _OverLimit(f"{source} is over {limits.max_bytes} bytes (max_bytes) once decoded")
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:  # ValueError: non-ASCII characters
        raise ValueError(f"{source} is not valid base64 ({exc})") from exc
    return _checked_bytes(data, limits, source)


def _checked_bytes(data: bytes, limits: ImageLimits, source: str) -> bytes:
    if not data:
        raise ValueError(f"{source} is empty")
    if len(data) > limits.max_bytes:
        raise _OverLimit(f"{source} is over {limits.max_bytes} bytes (max_bytes)")
    return data


def _load_file(path: str, limits: ImageLimits) -> LoadedImage:
    if not limits.allow_local_files:
        raise ValueError(f"local image files are off (ImageLimits.allow_local_files); got path {_show(path)}")
    if not path:
        raise ValueError("image path is empty")
    try:
        info = os.stat(path)
    except FileNotFoundError as exc:
        raise ValueError(f"no such image file {_show(path)}") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ValueError(f"cannot read image file {_show(path)}: {exc}") from exc
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"image path {_show(path)} is a directory, not a file")
    # A FIFO or device would block or never end on read; only regular files are images.
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"image path {_show(path)} is not a regular file")
    if info.st_size > limits.max_bytes:
        raise ValueError(f"image file {_show(path)} is {info.st_size} bytes, over {limits.max_bytes} (max_bytes)")
    try:
        with open(path, "rb") as file:
            data = file.read(limits.max_bytes + 1)  # the file may have grown since stat
    except OSError as exc:
        raise ValueError(f"cannot read image file {_show(path)}: {exc}") from exc
    source = f"image file {_show(path)}"
    return _decode(_checked_bytes(data, limits, source), limits, source)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only: urllib would also follow one to ftp."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if not newurl.lower().startswith(("http://", "https://")):
            raise urllib.error.HTTPError(newurl, code, f"redirect to a non-http(s) URL {_show(newurl)}", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _load_url(url: str, limits: ImageLimits) -> LoadedImage:
    if not limits.allow_remote:
        raise ValueError(
            f"remote images are off (a server must not fetch arbitrary addresses); start the engine with "
            f"allow_remote_images=True (ImageLimits.allow_remote) to fetch {_show(url)}"
        )
    source = f"the image at {_show(url)}"
    data = _download(url, limits, source)
    return _decode(_checked_bytes(data, limits, source), limits, source)


def _download(url: str, limits: ImageLimits, source: str) -> bytes:
    """Fetch at most max_bytes + 1 bytes (enough to tell "too big"), giving up once remote_timeout_s has passed."""
    deadline = time.monotonic() + limits.remote_timeout_s
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    timed_out = f"{source} took longer than {limits.remote_timeout_s} s (remote_timeout_s)"
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "furcate"})
        with opener.open(request, timeout=limits.remote_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise _OverLimit(f"{source} is {declared} bytes, over {limits.max_bytes} (max_bytes)")
            return _read_capped(response, limits, deadline, source, timed_out)
    except _OverLimit:
        raise
    except urllib.error.HTTPError as exc:  # before OSError: it is one, and its status is the useful part
        raise ValueError(f"cannot fetch {source}: HTTP {exc.code} {exc.reason}") from exc
    except TimeoutError as exc:
        raise ValueError(timed_out) from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise ValueError(timed_out) from exc
        raise ValueError(f"cannot fetch {source}: {exc.reason}") from exc
    # OSError: connection reset and the like; HTTPException: a malformed reply; ValueError: a malformed URL.
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ValueError(f"cannot fetch {source}: {type(exc).__name__}: {exc}") from exc


def _read_capped(
    response: http.client.HTTPResponse, limits: ImageLimits, deadline: float, source: str, timed_out: str
) -> bytes:
    """Stream the body, stopping at max_bytes + 1 bytes or at the deadline.

    urllib's timeout bounds each socket operation, not the transfer: a server dripping a byte at a time would never
    trip it, so the loop checks a deadline too. read1 returns what one socket read gave, so the checks come often.
    """
    chunks: list[bytes] = []
    received = 0
    while received <= limits.max_bytes:
        if time.monotonic() > deadline:
            raise _OverLimit(timed_out)
        chunk = response.read1(min(_READ_CHUNK, limits.max_bytes + 1 - received))
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
    if received > limits.max_bytes:
        raise _OverLimit(f"{source} is over {limits.max_bytes} bytes (max_bytes)")
    return b"".join(chunks)


def _decode(data: bytes, limits: ImageLimits, source: str) -> LoadedImage:
    # Warnings are scoped here rather than set on PIL's globals, which belong to whoever else uses PIL in-process.
    # (catch_warnings swaps the process-wide filter list: concurrent threads may briefly see each other's filters.)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our max_pixels check below is the limit
        # PIL warns about damage it worked around (corrupt EXIF, short reads): the image either decodes or is
        # refused below, and a server's log is no place for one user's broken metadata.
        warnings.filterwarnings("ignore", category=UserWarning, module="PIL")
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except Image.DecompressionBombError as exc:
            raise ValueError(f"{source} declares too many pixels ({exc})") from exc
        except Image.UnidentifiedImageError as exc:
            raise ValueError(f"{source} is not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from exc
        # Decoders of untrusted bytes fail in an open set of ways (OSError, SyntaxError, struct.error, IndexError,
        # ...); the contract is that any of them is a bad image, reported as ValueError.
        except Exception as exc:
            raise ValueError(f"{source} is not a readable image: {type(exc).__name__}: {exc}") from exc
        with image:
            return _finish(image, limits, source)


def _finish(image: Image.Image, limits: ImageLimits, source: str) -> LoadedImage:
    """Check size from the header, then decode, convert to RGB and hash; the caller's image is never modified."""
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"{source} has no pixels ({width}x{height})")
    # PIL opens lazily: size comes from the header, so a bomb is refused here before any pixel is decoded.
    if width * height > limits.max_pixels:
        raise ValueError(
            f"{source} is {width}x{height} = {width * height} pixels, over {limits.max_pixels} (max_pixels)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="PIL")
        try:
            image.load()  # an animated image stays on its first frame
            rgb = _to_rgb(image)
        except Image.DecompressionBombError as exc:
            raise ValueError(f"{source} declares too many pixels ({exc})") from exc
        except Exception as exc:  # truncated data, bad chunks, unsupported modes: see _decode
            raise ValueError(f"{source} is not a readable image: {type(exc).__name__}: {exc}") from exc
    return LoadedImage(image=rgb, digest=pixel_digest(rgb))


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB with 8 bits a channel; always a new image, so later edits to the caller's image change nothing here."""
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        # Pillow clips 16-bit values to 0..255 instead of scaling; keep the top byte, as an 8-bit export would.
        # "I" is how some plugins open 16-bit grayscale, so it is read as 0..65535 too.
        pixels = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8
        return Image.fromarray(pixels.astype(np.uint8)).convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        # Composite over white, as HF processors' convert_to_rgb does: dropping alpha would show whatever color
        # hides under transparent pixels (often black), which is not the picture the user sees.
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def pixel_digest(image: Image.Image) -> str:
    """Hex sha256 over width, height and the RGB bytes: equal pictures hash alike whatever their encoding.

    The size is hashed as fixed-width integers so that pictures whose bytes agree but whose shapes differ (2x6 vs
    3x4) do not collide.
    """
    if image.mode != "RGB":
        raise ValueError(f"pixel_digest needs an RGB image, got mode {image.mode}")
    digest = hashlib.sha256(b"furcate-rgb8")
    digest.update(struct.pack("<QQ", *image.size))
    digest.update(image.tobytes())
    return digest.hexdigest()


def _show(value: object) -> str:
    """A user's value for a message, cut so a megabyte of base64 ends up in no error message or log."""
    if isinstance(value, str | bytes | bytearray):
        # Slice before repr: repr of the whole of a large value would cost as much as the value.
        shown = repr(value[: _SHOWN_CHARS + 1])
    else:
        shown = _SHORT_REPR.repr(value)  # reprlib also survives a __repr__ that raises
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 3] + "..."
