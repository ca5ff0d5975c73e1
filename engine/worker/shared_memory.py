"""Memory shared between the engine process and its model worker: anonymous files mapped in
both, passed to the worker as inherited file descriptors.

A ``SharedBuffer`` is an anonymous in-memory file (``memfd_create`` where the platform has it,
else an unlinked temporary file) mapped read-write; tensors are views of the mapping, so what
one process writes the other reads without a copy. No name is ever registered anywhere, so
nothing is left behind when both processes end, however they end.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

import torch

from baton.kernels.quant_formats import QuantWeight


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lies in a shared buffer (picklable, sent to the worker)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class QuantLayout:
    """Where one GGUF-quantised weight (``QuantWeight``) lies in a shared buffer: its packed
    bytes (uint8, 1-D) and what they are (picklable, sent to the worker)."""

    format: str
    n: int
    k: int
    data: TensorLayout


class SharedBuffer:
    """A mapped anonymous file; ``fd`` is what a child process inherits to map it too.

    Args:
        fd: the file descriptor (owned by this object from now on).
        nbytes: its size.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)

    @classmethod
    def create(cls, nbytes: int, name: str) -> SharedBuffer:
        """A new zero-filled buffer of ``nbytes`` (at least one byte is mapped).

        Raises:
            OSError: the memory cannot be had (its message says why).
        """
        nbytes = max(1, nbytes)
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create(name, 0)  # not close-on-exec: the worker inherits it
        else:
            handle, path = tempfile.mkstemp(prefix=name)
            os.unlink(path)
            fd = handle
            os.set_inheritable(fd, True)
        try:
            os.ftruncate(fd, nbytes)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, nbytes)

    def tensor(self, layout: TensorLayout) -> torch.Tensor:
        """The tensor at ``layout``: a view of the shared memory."""
        end = layout.offset + layout.nbytes
        if end > self.nbytes:
            raise ValueError(f"tensor at {layout.offset}..{end} lies past the buffer's end")
        return self._bytes[layout.offset : end].view(layout.dtype).view(layout.shape)

    def quant_weight(self, layout: QuantLayout) -> QuantWeight:
        """The quantised weight at ``layout``: its bytes a view of the shared memory."""
        return QuantWeight(layout.format, layout.n, layout.k, self.tensor(layout.data))

    def release(self, layout: TensorLayout) -> None:
        """Frees the memory behind the whole pages of ``layout``'s range (``MADV_REMOVE``: the
        file's pages go, for every process that maps it; a later read sees zeros). For a
        tensor copied elsewhere whose bytes no one reads here any more. A no-op where the
        platform has no such advice or the buffer is closed.

        Raises:
            ValueError: the range lies past the buffer's end.
        """
        end = layout.offset + layout.nbytes
        if end > self.nbytes:
            raise ValueError(f"tensor at {layout.offset}..{end} lies past the buffer's end")
        advice = getattr(mmap, "MADV_REMOVE", None)
        if self._map is None or advice is None:
            return
        lo = -(-layout.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = end // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            self._map.madvise(advice, lo, hi - lo)

    def close(self) -> None:
        """Closes the descriptor; the mapping stays valid while tensors view it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pack_layouts(
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], align: int = 64
) -> tuple[dict[str, TensorLayout], int]:
    """Lays tensors out one after another (each ``align``-byte aligned); returns the layouts
    and the total size."""
    layouts: dict[str, TensorLayout] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        layout = TensorLayout(offset, dtype, tuple(shape))
        layouts[name] = layout
        offset += -(-layout.nbytes // align) * align
    return layouts, offset
