"""Where the model runner's work runs, and how values cross between the host and that device.

This is the one place that knows CPU from CUDA. On the CPU the host is the device: arrays become
tensors without a copy, results need no copy back, and nothing waits. On CUDA the runner's work
is queued on its own stream; host values reach the device through pinned staging memory with
non-blocking copies (never a pageable copy, which would block the host), and results come back
on a side stream into pinned host memory, behind an event that is waited for only when a result
is collected (`HostCopy.wait`). Pinned memory comes from torch's caching host allocator, which
does not hand a block out again before the copies that used it have finished.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch


def stage_to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The host arrays (one dtype) as tensors of the same shapes on ``device``, in one copy.

    On the CPU: views of the arrays, no copy. Elsewhere: packed into one pinned buffer and
    copied with ``non_blocking=True`` on the current stream, so the host never waits.

    Raises:
        ValueError: if the arrays do not share one dtype.
    """
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) > 1:
        raise ValueError(f"arrays to stage must share one dtype, got {sorted(map(str, dtypes))}")
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    if not arrays:
        return []
    flat = np.concatenate([a.reshape(-1) for a in arrays])
    staged = torch.from_numpy(flat).pin_memory().to(device, non_blocking=True)
    parts = staged.split([a.size for a in arrays])
    return [p.view(a.shape) for p, a in zip(parts, arrays, strict=True)]


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
    """The runner's device, its compute stream and its copy-back stream (both None on the CPU).

    Build it with `DeviceIO.for_device`. All methods are no-copy, no-wait passthroughs on the CPU.
    """

    device: torch.device
    stream: torch.cuda.Stream | None = None
    copy_stream: torch.cuda.Stream | None = None

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

    def to_device(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """`stage_to_device` onto this device (inside `on_stream`, on the runner's stream)."""
        return stage_to_device(arrays, self.device)

    def tensor_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device: itself on the CPU; on CUDA a pinned copy (taken now, so
        the caller may reuse ``tensor`` at once) sent with ``non_blocking=True``."""
        if self.is_host or tensor.device == self.device:
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

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
