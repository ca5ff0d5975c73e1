"""GGUF block formats in the layout of the quantised linear kernel (``quant_linear.py``): the
repacking from a GGUF tensor's block bytes, and the torch dequantisation of that layout.

A weight ``[n, k]`` is cut into tiles of ``TILE`` rows (the last padded with zero rows); a
tile holds, one after another, each *section* of its format for all its rows: a section is
``[units][TILE][width]`` values, a unit being 32 weights (a block) or 256 (a K-quant super
block). Each tile is thus one sequential stream for the kernel, and the scales of a tile come
before its quants so that they can be converted to float32 once per tile. The 4-bit quants of
every format are stored as Q4_0 stores them: byte j of a 32-weight block holds weight j in its
low nibble and weight j + 16 in its high nibble. Nothing is widened: the layout takes the bytes
of the file, plus at most three padding rows (Q4_K: 4 more bytes per 256 weights, its 6-bit
scales as bytes; Q6_K: the same size as the file, its 2-bit high parts regrouped so that a byte
holds weights j, j + 8, j + 16 and j + 24 of a block).

``dequantize`` computes what ``gguf.quants.dequantize`` computes, bit for bit (the same float32
products and roundings), from the packed layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

TILE = 4
"""Rows of W per tile of the packed layout (the C++ ``kTile``)."""


@dataclass(frozen=True)
class Section:
    """One array of a tile: ``units`` of ``unit_weights`` weights each, per row, ``width``
    values of ``dtype`` per unit and row."""

    name: str
    dtype: np.dtype
    unit_weights: int
    width: int


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format the kernel takes.

    Attributes:
        code: the C++ format code.
        block_bytes: bytes of one block in the GGUF file.
        block_weights: weights of one block in the file (32, or 256 for K-quants).
        sections: the packed layout of a tile, in order.
    """

    code: int
    block_bytes: int
    block_weights: int
    sections: tuple[Section, ...]

    def packed_nbytes(self, n: int, k: int) -> int:
        """Bytes of a ``[n, k]`` weight in the packed layout (``n`` padded to whole tiles)."""
        tile = sum(k // s.unit_weights * TILE * s.width * s.dtype.itemsize for s in self.sections)
        return -(-n // TILE) * tile


_F16, _U8, _I8 = np.dtype(np.float16), np.dtype(np.uint8), np.dtype(np.int8)

FORMATS: dict[str, BlockFormat] = {
    "Q8_0": BlockFormat(0, 34, 32, (Section("d", _F16, 32, 1), Section("q", _I8, 32, 32))),
    "Q4_0": BlockFormat(1, 18, 32, (Section("d", _F16, 32, 1), Section("q", _U8, 32, 16))),
    "Q4_1": BlockFormat(
        2,
        20,
        32,
        (Section("d", _F16, 32, 1), Section("m", _F16, 32, 1), Section("q", _U8, 32, 16)),
    ),
    "Q4_K": BlockFormat(
        3,
        144,
        256,
        (
            Section("d", _F16, 256, 1),
            Section("dmin", _F16, 256, 1),
            Section("sc", _U8, 32, 1),
            Section("m", _U8, 32, 1),
            Section("q", _U8, 32, 16),
        ),
    ),
    "Q6_K": BlockFormat(
        4,
        210,
        256,
        (Section("d", _F16, 256, 1), Section("sc", _I8, 32, 2), Section("q", _U8, 32, 24)),
    ),
}
"""GGUF tensor type name -> its format, for every type the kernel multiplies."""


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight ``[n, k]`` repacked for the kernel (see `repack`).

    Attributes:
        format: the GGUF type name (a key of `FORMATS`).
        n: output features (rows of W).
        k: input features (a multiple of the format's block weights).
        data: the packed bytes, 1-D uint8: ceil(n / TILE) tiles of the format's sections.
    """

    format: str
    n: int
    k: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds in memory."""
        return self.data.numel()


def block_format(format: str) -> BlockFormat:
    """``FORMATS[format]``.

    Raises:
        ValueError: the type has no kernel (the message lists those that have one).
    """
    if format not in FORMATS:
        raise ValueError(
            f"tensor type {format!r} has no quantised kernel; supported: {', '.join(FORMATS)}"
        )
    return FORMATS[format]


def _nibbles_q4_0_order(values: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 -> [..., 16] bytes, weight j low, weight j + 16 high."""
    return values[..., :16] | (values[..., 16:] << 4)


def _split_simple(blocks: np.ndarray, fmt: BlockFormat) -> dict[str, np.ndarray]:
    heads = [s for s in fmt.sections if s.name != "q"]
    out = {s.name: blocks[..., 2 * i : 2 * i + 2] for i, s in enumerate(heads)}
    out["q"] = blocks[..., 2 * len(heads) :]
    return out


def _split_q4_k(blocks: np.ndarray, fmt: BlockFormat) -> dict[str, np.ndarray]:
    n, nsb = blocks.shape[:2]
    # gguf's Q4_K.get_scale_min: eight 6-bit scales and mins packed in 12 bytes.
    s = blocks[..., 4:16].reshape(n, nsb, 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    # Each 32 bytes of qs: sub-block 2j in the low nibbles, 2j + 1 in the high ones.
    qs = blocks[..., 16:].reshape(n, nsb, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    values = (qs & 0x0F).reshape(n, nsb * 8, 32)
    return {
        "d": blocks[..., 0:2],
        "dmin": blocks[..., 2:4],
        "sc": sc.reshape(n, nsb * 8, 1),
        "m": mins.reshape(n, nsb * 8, 1),
        "q": _nibbles_q4_0_order(values),
    }


def _split_q6_k(blocks: np.ndarray, fmt: BlockFormat) -> dict[str, np.ndarray]:
    n, nsb = blocks.shape[:2]
    # As gguf's Q6_K.dequantize_blocks: 256 six-bit values from ql (low 4) and qh (high 2).
    ql = blocks[..., :128].reshape(n, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    values = (ql & 0x0F).reshape(n, nsb * 8, 32) | ((qh & 0x03).reshape(n, nsb * 8, 32) << 4)
    high = values >> 4  # byte j of the pairs: weights j, j + 8, j + 16, j + 24
    pairs = high[..., 0:8] | high[..., 8:16] << 2 | high[..., 16:24] << 4 | high[..., 24:32] << 6
    q = np.concatenate([_nibbles_q4_0_order(values & 0x0F), pairs], axis=-1)
    return {"d": blocks[..., 208:210], "sc": blocks[..., 192:208].reshape(n, nsb * 8, 2), "q": q}


_SPLIT: dict[str, Callable[[np.ndarray, BlockFormat], dict[str, np.ndarray]]] = {
    "Q8_0": _split_simple,
    "Q4_0": _split_simple,
    "Q4_1": _split_simple,
    "Q4_K": _split_q4_k,
    "Q6_K": _split_q6_k,
}


def repack(raw: np.ndarray, format: str) -> QuantWeight:
    """The weight whose GGUF blocks are ``raw`` (uint8 ``[n, k / block_weights * block_bytes]``,
    a tensor's ``data`` as ``engine/loader/gguf_reader.py`` maps it) in the kernel's layout.

    Reads ``raw`` (a view of a memory map is fine) and returns a new array about its size (see
    the module docstring); never a float copy.

    Raises:
        ValueError: ``format`` has no kernel, or ``raw`` is not a 2-D uint8 array whose rows are
            whole blocks of the format.
    """
    fmt, n, k = check_raw(raw, format)
    row_bytes = raw.shape[1]
    blocks = raw.reshape(n, row_bytes // fmt.block_bytes, fmt.block_bytes)
    pad = -n % TILE
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, *blocks.shape[1:]), np.uint8)])
    tiles = (n + pad) // TILE
    parts = _SPLIT[format](blocks, fmt)
    packed = []
    for s in fmt.sections:
        part = np.ascontiguousarray(parts[s.name]).view(np.uint8)
        part = part.reshape(tiles, TILE, part.shape[1], -1).transpose(0, 2, 1, 3)
        packed.append(part.reshape(tiles, -1))
    data = np.concatenate(packed, axis=1).reshape(-1)
    return QuantWeight(format, n, k, torch.from_numpy(data))


def check_raw(raw: object, format: str) -> tuple[BlockFormat, int, int]:
    """The format, n and k of GGUF block bytes ``raw`` (see `repack`).

    Raises:
        ValueError: as `repack`.
    """
    fmt = block_format(format)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        got = f"{raw.dtype} {raw.shape}" if isinstance(raw, np.ndarray) else type(raw).__name__
        raise ValueError(f"raw must be a 2-D uint8 array of {format} blocks, got {got}")
    n, row_bytes = raw.shape
    if n == 0 or row_bytes == 0 or row_bytes % fmt.block_bytes:
        raise ValueError(
            f"raw rows of {row_bytes} bytes are not whole {format} blocks of {fmt.block_bytes}"
        )
    return fmt, n, row_bytes // fmt.block_bytes * fmt.block_weights


def unpack(weight: QuantWeight, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The sections of ``weight`` as tensors ``[n, units, width]`` of their dtypes, or of the
    given ``rows`` only (an int64 index tensor; ``[len(rows), units, width]``). Copies."""
    fmt = block_format(weight.format)
    data = weight.data.view(-(-weight.n // TILE), -1)
    if rows is not None:
        data = data[rows // TILE]  # the tiles holding the rows, in the order asked
    out, offset = {}, 0
    for s in fmt.sections:
        units = weight.k // s.unit_weights
        size = units * TILE * s.width * s.dtype.itemsize
        part = data[:, offset : offset + size].contiguous().view(getattr(torch, s.dtype.name))
        part = part.view(-1, units, TILE, s.width)
        if rows is None:
            out[s.name] = part.transpose(1, 2).reshape(-1, units, s.width)[: weight.n]
        else:
            out[s.name] = part[torch.arange(len(rows)), :, rows % TILE]
        offset += size
    return out


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    return torch.cat([q & 0x0F, q >> 4], dim=-1).float()


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """A super block's value [n, nsb, 1] repeated for its 8 blocks of 32: [n, nsb * 8, 1]."""
    return t.float().repeat_interleave(8, dim=1)


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """``weight`` as a float32 ``[n, k]`` tensor, bit-identical to ``gguf.quants.dequantize``;
    the torch reference of the kernel's weights. Allocates the full float32 matrix."""
    return _dequantize(weight, None)


def dequantize_rows(weight: QuantWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 indices, any 1-D order, repeats allowed) of the weight as float32
    ``[len(rows), k]``, as `dequantize` gives them: an embedding lookup in a quantised token
    embedding (which a tied LM head multiplies with as it is).

    Raises:
        ValueError: ``rows`` is not a 1-D integer tensor of indices in [0, n).
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.is_floating_point():
        raise ValueError(f"rows must be a 1-D integer tensor, got {rows!r:.80}")
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= weight.n):
        raise ValueError(f"rows must be in [0, {weight.n}), got {rows.min()}..{rows.max()}")
    return _dequantize(weight, rows.long())


def _dequantize(weight: QuantWeight, rows: torch.Tensor | None) -> torch.Tensor:
    p = unpack(weight, rows)
    if weight.format == "Q8_0":
        w = p["q"].float() * p["d"].float()
    elif weight.format == "Q4_0":
        w = p["d"].float() * (_nibbles(p["q"]) - 8)
    elif weight.format == "Q4_1":
        w = p["d"].float() * _nibbles(p["q"]) + p["m"].float()
    elif weight.format == "Q4_K":  # (d * sc) * q - dmin * m, each product exact in float32
        scale = _per_block(p["d"]) * p["sc"].float()
        w = scale * _nibbles(p["q"]) - _per_block(p["dmin"]) * p["m"].float()
    else:  # Q6_K: (d * sc) * (q - 32), sc per 16 weights, exact in float32
        scale = (_per_block(p["d"]) * p["sc"].float()).repeat_interleave(16, dim=-1)
        pairs = p["q"][..., 16:]
        high = torch.cat([(pairs >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-1)
        w = scale * ((_nibbles(p["q"][..., :16]) + 16 * high.float()) - 32)
    return w.reshape(-1, weight.k)
