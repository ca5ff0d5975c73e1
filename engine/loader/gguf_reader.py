"""A GGUF file's metadata and tensors, read straight from a memory map.

``gguf.GGUFReader`` builds a numpy view per value, so the default model's two 49k-entry string
arrays (tokens and merges) took 6.5 s to read; this reader parses the metadata with ``struct``
in about a tenth of a second and maps each tensor's data as ``GGUFReader`` does (the layout
``gguf.quants.dequantize`` takes). It reads GGUF versions 2 and 3, little-endian.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format of a scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can read (the message says where)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` lists dims fastest-first (as GGUF does); ``data`` is a read-only
    view of the file, shaped slowest-first, in bytes for block-quantised types."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)

    def release_pages(self) -> None:
        """Drops the file pages under ``data`` from this process's memory (they stay in the
        page cache; a later read maps them again, the same bytes): what a loader calls once it
        has copied the tensor, so that the copies and the mapped file are not resident
        together (an 8B-shape Q4_K_M file's load peaked at the file's size twice). No effect
        without a mapping or where the system has no ``madvise``."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED") or self.n_bytes == 0:
            return
        page = mmap.PAGESIZE
        start = self.data_offset // page * page
        end = min(len(self.mapping), -(-(self.data_offset + self.n_bytes) // page) * page)
        self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file: its metadata (plain Python values, lists for arrays, plus the
    ``GGUF.version`` / ``GGUF.tensor_count`` / ``GGUF.kv_count`` keys ``gguf.GGUFReader``
    adds) and its tensors in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError(f"the file ends inside its header (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string at byte {self.pos} runs past the end of the file")
        raw = self.buf[self.pos : end]
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {end - n} is not UTF-8 ({exc})") from None

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            sub, count = self.unpack("I"), self.unpack("Q")
            if sub in _NUMPY:
                width = np.dtype(_NUMPY[sub]).itemsize
                if self.pos + count * width > len(self.buf):
                    raise GGUFFormatError(f"an array at byte {self.pos} runs past the end")
                values = np.frombuffer(self.buf, _NUMPY[sub], count, self.pos)
                self.pos += count * width
                return values.tolist()
            return [self.value(sub) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.pos}")
        return self.unpack(fmt)


def read_gguf_file(path: Path) -> GGUFFile:
    """Reads ``path``'s metadata and maps its tensors (the file stays mapped while a tensor's
    ``data`` is referenced).

    Raises:
        OSError: the file cannot be opened or mapped.
        GGUFFormatError: not GGUF, an unsupported version, a duplicated tensor, an unknown
            tensor type, or data outside the file.
    """
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise GGUFFormatError("the file is empty") from None
    cur = _Cursor(buf)
    if buf[:4] != _MAGIC:
        raise GGUFFormatError(f"it does not start with {_MAGIC!r}")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in _VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (big-endian, or unsupported)")
    tensor_count, kv_count = cur.unpack("Q"), cur.unpack("Q")
    metadata: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GGUFFormatError(f"general.alignment is {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"tensor {name} is listed twice")
        seen.add(name)
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        data_offset = start + offset
        if data_offset + n_bytes > len(buf):
            raise GGUFFormatError(
                f"tensor {name} ends at byte {data_offset + n_bytes} but the file has "
                f"{len(buf)} bytes; the file is truncated"
            )
        shape = tuple(reversed(dims))
        plain = _PLAIN.get(kind)
        if plain is None:
            data = np.frombuffer(buf, np.uint8, n_bytes, data_offset)
            data = data.reshape(quant_shape_to_byte_shape(shape, kind))
        else:
            data = np.frombuffer(buf, plain, n_elements, data_offset).reshape(shape)
        tensors.append(GGUFTensor(name, kind, dims, n_elements, n_bytes, data_offset, data, buf))
    return GGUFFile(metadata, tensors)


__all__ = ["GGUFFile", "GGUFFormatError", "GGUFTensor", "read_gguf_file"]
