"""A GGUF file's metadata and tensor table, read in milliseconds.

gguf's GGUFReader builds a numpy view per field part, a million of them for a 49k-token vocabulary: ~2 s on every
engine start that runs a GGUF's quantized kernels (the default model's included). This reader walks the header
with struct, steps over the string arrays it is not asked for (the vocabulary, which the tokenizer conversion
reads itself) and gives each tensor the numpy view GGUFReader gives (values for float types, bytes per row for
blocks), so gguf.quants reads them unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types (GGUF spec): fixed-size scalars by struct format; 8 is a string, 9 an array.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
VALUE_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
               GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
               GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
               GGMLQuantizationType.I64: np.int64}
DEFAULT_ALIGNMENT = 32
# String arrays longer than this (vocabularies, merge tables) are stepped over unless asked for; shorter ones
# (general.languages, tags) are read. Scalar arrays longer than it stay numpy views of the file.
LONG_ARRAY = 256
MAX_NESTING = 4  # arrays of arrays; the spec allows them, no file needs deep ones


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: shape in GGUF order (fastest-varying dimension first), as GGUFReader lists it."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    values: dict[str, Any]  # long string arrays not asked for hold their length
    tensors: list[GGUFTensor]


class Cursor:
    """Reads little-endian values from the mapped file, moving forward."""

    def __init__(self, blob: np.ndarray) -> None:
        self.blob, self.pos = blob, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return bytes(self.take(length)).decode("utf-8")

    def take(self, nbytes: int) -> np.ndarray:
        """The next nbytes; a length past the end of the file (truncated, or hostile) is an error."""
        if self.pos + nbytes > self.blob.size:
            raise ValueError(f"a value of {nbytes} bytes at offset {self.pos} runs past the end of the file")
        self.pos += nbytes
        return self.blob[self.pos - nbytes : self.pos]

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (length,) = self.unpack("<Q")
            self.take(length)


def read_gguf(path: str, string_arrays: frozenset[str] = frozenset()) -> GGUFFile:
    """string_arrays: the long string arrays to read in full (the others are stepped over)."""
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    cursor = Cursor(blob)
    magic, version, tensor_count, value_count = cursor.unpack("<4sIQQ")
    if magic == b"GGUF" and int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
        raise ValueError("a big-endian GGUF file, which furcate does not read")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"no GGUF v2/v3 header (magic {magic!r}, version {version})")
    values = {}
    for _ in range(value_count):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        values[key] = read_value(cursor, kind, key in string_arrays)
    table = [tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"general.alignment {alignment!r} is no positive integer")
    start = -(-cursor.pos // alignment) * alignment
    return GGUFFile(values, [tensor_view(blob, start, *entry) for entry in table])


def read_value(cursor: Cursor, kind: int, keep_strings: bool, depth: int = 0) -> Any:
    """One metadata value; long scalar arrays (a vocabulary's token types and scores) as numpy arrays."""
    if kind in SCALARS:
        return cursor.unpack(SCALARS[kind])[0]
    if kind == STRING:
        return cursor.string()
    if kind != ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item_kind, count = cursor.unpack("<IQ")
    if item_kind in SCALARS:
        dtype = np.dtype(SCALARS[item_kind])
        items = cursor.take(count * dtype.itemsize).view(dtype)
        return items if count > LONG_ARRAY else items.tolist()
    if item_kind == STRING and not keep_strings and count > LONG_ARRAY:
        cursor.skip_strings(count)
        return count
    if depth >= MAX_NESTING:
        raise ValueError(f"metadata arrays nested deeper than {MAX_NESTING}")
    return [read_value(cursor, item_kind, keep_strings, depth + 1) for _ in range(count)]


def tensor_entry(cursor: Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, shape in GGUF order, type, offset in the data section) of the next tensor table entry."""
    name = cursor.string()
    (dims,) = cursor.unpack("<I")
    if not 1 <= dims <= 4:  # ggml's GGML_MAX_DIMS
        raise ValueError(f"tensor {name!r} has {dims} dimensions")
    shape = cursor.unpack(f"<{dims}Q")
    kind, offset = cursor.unpack("<IQ")
    return name, shape, GGMLQuantizationType(kind), offset


def tensor_view(blob: np.ndarray, start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
    """Values for float and integer types; bytes per row, in whole blocks, for quantized ones."""
    rows = tuple(reversed(shape[1:]))
    if kind in VALUE_TYPES:
        dtype = np.dtype(VALUE_TYPES[kind])
        view_shape, nbytes = (*rows, shape[0]), int(np.prod(shape)) * dtype.itemsize
    else:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if shape[0] % block:
            raise ValueError(f"tensor {name!r}: rows of {shape[0]} are no whole {kind.name} blocks of {block}")
        dtype, row_bytes = np.dtype(np.uint8), shape[0] // block * block_bytes
        view_shape, nbytes = (*rows, row_bytes), int(np.prod(rows, dtype=np.int64)) * row_bytes
    begin = start + offset
    if begin + nbytes > blob.size:
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    return GGUFTensor(name, shape, kind, blob[begin : begin + nbytes].view(dtype).reshape(view_shape))
