"""Where the model runner's work runs, and how values cross between the host and that device.

This is the one place that knows CPU from CUDA. On the CPU the host is the device: arrays become
tensors without a copy, results need no copy back, and nothing waits. On CUDA the runner's work
is queued on its own stream; host values reach the device through pinned staging memory with
non-blocking copies (never a pageable copy, which would block the host), and results come back
on a side stream into pinned host memory, behind an event that is waited for only when a result
is collected (`HostCopy.wait`).

The runner's inputs go through one persistent pinned buffer (`PinnedStaging`): the H200 profile
of stop 40 had ``pin_memory()`` per transfer (allocation, host copy, pointer checks) cost about
0.1 ms of host time each, several times a decode step. A region of that buffer is handed out
again only after the copy that read it has finished (`StagingRing`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

HostArray = np.ndarray | torch.Tensor
"""A host value to stage: a numpy array or a CPU tensor (read without numpy, so a sync checker
sees no host read)."""

_ALIGN = 64
"""Each staged array starts at a multiple of this many bytes: any dtype can view it, and Triton,
which specialises (and compiles) a kernel for pointers divisible by 16 or not, sees every staged
tensor alike whatever the sizes before it in the region."""


class Fence(Protocol):
    """What `StagingRing` needs of an event recorded after a copy (``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class StagingRing:
    """Byte offsets in a ring buffer of ``capacity`` bytes, each region held until its fence.

    `take` hands out the next ``nbytes`` (wrapping to the start when the end is too near);
    `hold` ties the region just taken to a fence (the event after the copy that reads it). A
    region still held by a fence that has not passed is waited for before it is handed out
    again. Fences pass in the order they were held (one stream), so passed ones are dropped
    from the front without waiting.
    """

    def __init__(self, capacity: int) -> None:
        """Raises: ValueError: capacity < 1."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._pos = 0
        self._held: deque[tuple[int, int, Fence]] = deque()
        self._last = (0, 0)
        self.waits = 0
        """How many times `take` had to wait for a fence (a ring too small for the copies in
        flight)."""

    def take(self, nbytes: int) -> int:
        """The offset of ``nbytes`` free bytes, waiting for the fences of any region still held
        there.

        Raises:
            ValueError: ``nbytes`` < 0 or larger than the ring.
        """
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"cannot stage {nbytes} bytes in a ring of {self.capacity}")
        start = self._pos if self._pos + nbytes <= self.capacity else 0
        end = start + nbytes
        while self._held and self._held[0][2].query():
            self._held.popleft()
        overlapping = [i for i, (lo, hi, _) in enumerate(self._held) if lo < end and start < hi]
        if overlapping:
            # The newest overlapping copy passing means every older one has passed too.
            self.waits += 1
            self._held[overlapping[-1]][2].synchronize()
            for _ in range(overlapping[-1] + 1):
                self._held.popleft()
        self._pos = end
        self._last = (start, end)
        return start

    def hold(self, fence: Fence) -> None:
        """Holds the region of the last `take` until ``fence`` passes."""
        start, end = self._last
        if end > start:
            self._held.append((start, end, fence))


@dataclass
class PinnedStaging:
    """A persistent pinned host buffer through which host arrays reach a CUDA device.

    `to_device` packs arrays of any dtypes into one region (each 64-byte aligned), copies it
    with one non-blocking transfer on the current stream, and returns device views of it. A
    transfer larger than the buffer falls back to a pinned copy of its own.
    """

    device: torch.device
    capacity: int = 32 << 20
    _host: torch.Tensor = field(init=False, repr=False)
    _bytes: np.ndarray = field(init=False, repr=False)
    _ring: StagingRing = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._host = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
        self._bytes = self._host.numpy()
        self._ring = StagingRing(self.capacity)

    @property
    def waits(self) -> int:
        """Transfers that had to wait for an earlier one's copy to finish (expected: 0)."""
        return self._ring.waits

    def to_device(self, arrays: Sequence[HostArray]) -> list[torch.Tensor]:
        """The arrays as device tensors of the same shapes and dtypes, in one copy."""
        if not arrays:
            return []
        offsets, total = packed_layout(arrays)
        if total > self.capacity:
            return [_pinned(a).to(self.device, non_blocking=True) for a in arrays]
        base = self._write(arrays, offsets, total)
        device_bytes = torch.empty(total, dtype=torch.uint8, device=self.device)
        device_bytes.copy_(self._host[base : base + total], non_blocking=True)
        self._fence()
        return unpack(device_bytes, arrays, offsets)

    def copy_into(self, dst: torch.Tensor, array: np.ndarray) -> None:
        """Queues a copy of ``array`` into the contiguous device tensor ``dst`` of its shape and
        dtype (one transfer, no device allocation).

        Raises:
            ValueError: ``dst`` is not contiguous or not of ``array``'s shape and dtype.
        """
        check_copy_into(dst, array)
        if array.nbytes > self.capacity:
            dst.copy_(_pinned(array), non_blocking=True)
            return
        base = self._write([array], [0], -(-array.nbytes // _ALIGN) * _ALIGN)
        src = self._host[base : base + array.nbytes].view(dst.dtype).view(dst.shape)
        dst.copy_(src, non_blocking=True)
        self._fence()

    def _write(self, arrays: Sequence[HostArray], offsets: Sequence[int], total: int) -> int:
        base = self._ring.take(total)
        for a, off in zip(arrays, offsets, strict=True):
            if isinstance(a, torch.Tensor):
                dst = self._host[base + off : base + off + a.nbytes].view(a.dtype)
                dst.view(a.shape).copy_(a)
            else:
                dst = self._bytes[base + off : base + off + a.nbytes].view(a.dtype)
                np.copyto(dst.reshape(a.shape), a, casting="no")
        return base

    def _fence(self) -> None:
        done = torch.cuda.Event()
        done.record()
        self._ring.hold(done)


def _pinned(a: HostArray) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.pin_memory()
    return torch.from_numpy(np.ascontiguousarray(a)).pin_memory()


def check_copy_into(dst: torch.Tensor, array: np.ndarray) -> None:
    """Raises ValueError unless ``dst`` is a contiguous tensor of ``array``'s shape and dtype."""
    if not dst.is_contiguous():
        raise ValueError("copy_into needs a contiguous destination")
    if tuple(dst.shape) != array.shape or dst.dtype != torch_dtype(array.dtype):
        raise ValueError(
            f"copy_into: destination {dst.dtype}{tuple(dst.shape)} does not match the array "
            f"{array.dtype}{array.shape}"
        )


def packed_layout(arrays: Sequence[HostArray]) -> tuple[list[int], int]:
    """Each array's byte offset in one buffer (64-byte aligned) and the buffer's size."""
    offsets = []
    total = 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, total


def unpack(
    packed: torch.Tensor, arrays: Sequence[HostArray], offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Views of a uint8 tensor packed by `packed_layout` as tensors shaped like ``arrays``."""
    out = []
    for a, off in zip(arrays, offsets, strict=True):
        out.append(packed[off : off + a.nbytes].view(torch_dtype(a.dtype)).view(tuple(a.shape)))
    return out


def torch_dtype(dtype: np.dtype | torch.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (as ``torch.from_numpy`` maps it); a torch dtype as it
    is.

    Raises:
        TypeError: a dtype torch has no tensors of.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    return _numpy_to_torch(np.dtype(dtype))


@functools.cache
def _numpy_to_torch(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@dataclass(frozen=True)
class HostCopy:
    """Device values on their way to host memory; `wait` returns them once they are there.

    Attributes:
        tensors: host tensors (pinned on CUDA, the device tensors themselves on the CPU).
        done: event recorded after the copies, or None when nothing needs waiting for.
    """

    tensors: tuple[torch.Tensor, ...]
    done: torch.cuda.Event | None = None

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Blocks until the copies are complete (the caller's one wait) and returns the tensors."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensors


@dataclass(frozen=True)
class DeviceIO:
    """The runner's device, its compute and copy-back streams and its pinned staging buffer (all
    None on the CPU; a CUDA device always gets a staging buffer).

    Build it with `DeviceIO.for_device`. All methods are no-copy, no-wait passthroughs on the CPU.
    """

    device: torch.device
    stream: torch.cuda.Stream | None = None
    copy_stream: torch.cuda.Stream | None = None
    staging: PinnedStaging | None = None

    def __post_init__(self) -> None:
        # Every transfer to a CUDA device goes through the staging buffer: one is made here
        # when the caller built the streams without it.
        if self.staging is None and self.device.type != "cpu":
            object.__setattr__(self, "staging", PinnedStaging(self.device))

    @classmethod
    def for_device(cls, device: torch.device | str) -> DeviceIO:
        """Streams for ``device``; on CUDA the compute stream first waits for work already queued
        on the current stream (weights and caches being copied in)."""
        device = torch.device(device)
        if device.type == "cpu":
            return cls(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CPU or CUDA device, got {device}")
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return cls(device, stream, torch.cuda.Stream(device))

    @property
    def is_host(self) -> bool:
        """Whether the device is the CPU itself (its work runs as it is called)."""
        return self.device.type == "cpu"

    def on_stream(self) -> AbstractContextManager[object]:
        """Context in which the runner's work is queued: its stream on CUDA, nothing on the CPU."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def to_device(self, arrays: Sequence[HostArray]) -> list[torch.Tensor]:
        """The host arrays or CPU tensors (any dtypes) as tensors of the same shapes on this
        device, queued inside `on_stream`: the arrays' own memory on the CPU, one copy through
        the pinned `PinnedStaging` buffer on CUDA (the caller may reuse the arrays at once)."""
        if self.staging is None:  # the CPU
            return [a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for a in arrays]
        return self.staging.to_device(arrays)

    def copy_into(self, dst: torch.Tensor, array: np.ndarray) -> None:
        """Queues a copy of ``array`` into the contiguous tensor ``dst`` on this device, of its
        shape and dtype (inside `on_stream`): through `PinnedStaging` on CUDA.

        Raises:
            ValueError: ``dst`` is not contiguous or not of ``array``'s shape and dtype.
        """
        if self.staging is not None:
            self.staging.copy_into(dst, array)
            return
        check_copy_into(dst, array)
        dst.copy_(torch.from_numpy(array))  # the CPU

    def to_host(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Starts copying device tensors to host memory; `HostCopy.wait` collects them.

        On CUDA the copies run on the side stream after an event recorded on the current stream,
        into pinned memory; the sources are kept alive for the side stream. On the CPU the
        tensors are returned as they are.
        """
        if self.copy_stream is None:
            return HostCopy(tuple(tensors))
        ready = torch.cuda.Event()
        ready.record()
        self.copy_stream.wait_event(ready)
        hosts = []
        with torch.cuda.stream(self.copy_stream):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.copy_stream)
                hosts.append(host)
            done = torch.cuda.Event()
            done.record()
        return HostCopy(tuple(hosts), done)

    def mark(self) -> torch.cuda.Event | float:
        """A point in the device's timeline: a timing event queued on the runner's stream on
        CUDA, the host clock on the CPU (where the work runs as it is called)."""
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    @staticmethod
    def seconds_between(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Seconds between two `mark`s; on CUDA both events must have completed (no wait)."""
        if isinstance(start, float) and isinstance(end, float):
            return end - start
        return start.elapsed_time(end) / 1000.0
