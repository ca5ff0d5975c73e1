"""The suite's memory: each pytest process's peak resident memory per test file, recorded on
request and bounded always.

An xdist worker of ``make test`` was once killed by the kernel's out-of-memory killer at 8.5 GB
resident, beside one other engine process, and ~200 tests never ran. This plugin keeps that
from creeping back silently:

- the bound: after each test (its fixtures' teardown included) the worker's peak resident
  memory since its file began (Linux ``VmHWM``, reset per file through
  ``/proc/self/clear_refs``) must stay under ``$BATON_TEST_RSS_LIMIT_GB`` (default 4; 0 turns
  the check off); past it the test's teardown errors, naming the file, the test and the peak.
- the record: with ``$BATON_TEST_RSS_LOG`` set to a file, one JSON line per test file and
  process is appended to it: the peak, the resident memory left after the file (once given
  back, below), and the resident memory of the process's live children (engine worker and
  grammar compile processes).

It also gives memory back between tests, measured to matter in this suite (issue 52): after
each test glibc's ``malloc_trim`` returns the heap's free pages (after
tests/engine/entrypoints/test_engine.py a worker held 6.3 GB resident, 3.4 GB once trimmed);
after a file that left the process bigger, the objects that engines froze out of the garbage
collector's passes (``engine/gc_heap.py``) are unfrozen and collected first (after
tests/engine/entrypoints/test_structured.py: 6.5 GB, 4.9 GB collected, 1.3 GB trimmed).

Linux only (it reads /proc and resets the peak through /proc/self/clear_refs, Linux 4.0 on);
elsewhere it records and bounds nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

LIMIT_ENV = "BATON_TEST_RSS_LIMIT_GB"
LOG_ENV = "BATON_TEST_RSS_LOG"
DEFAULT_LIMIT_GB = 4.0
# Growth over a file past which its end collects garbage (see ``release_memory``).
RETAINED_BYTES = 256 << 20
_GB = 1 << 30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(pid: int | str = "self") -> dict[str, int]:
    """``VmHWM`` (peak resident) and ``VmRSS`` (resident now) of process ``pid`` in bytes;
    empty when the process is gone or /proc is absent."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Start a new ``VmHWM`` window for this process (Linux >= 4.0); False where it cannot."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


def trim_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc's ``malloc_trim``; a few
    microseconds): freed tensors otherwise stay resident in the arenas of the threads that
    allocated them. Nothing where the C library has no ``malloc_trim``."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def release_memory(resident_at_start: int) -> None:
    """What a test file leaves behind, given back: the heap trimmed, and where that leaves the
    process more than ``RETAINED_BYTES`` above ``resident_at_start`` (its resident bytes when
    the file began), the objects engines froze out of the collector's passes unfrozen (as an
    engine's shutdown does; an engine a test dropped without shutting it down would otherwise
    stay frozen, model and caches included), reference cycles collected and the heap trimmed
    again. The collection is skipped otherwise: a full pass over the suite's heap (~380k
    objects) took 0.2-0.5 s per file, more than most files' tests."""
    trim_heap()
    if status_bytes().get("VmRSS", 0) - resident_at_start <= RETAINED_BYTES:
        return
    gc.unfreeze()
    gc.collect()
    trim_heap()


def _children(pid: int) -> list[int]:
    """Live descendants of ``pid`` (threads' children included), from /proc."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                kids = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for kid in kids:
                found.append(int(kid))
                todo.append(int(kid))
    return found


def children_bytes() -> dict[str, int]:
    """Sum of live descendants' ``VmRSS`` and the largest one's ``VmHWM``, and their count."""
    rss = peak = count = 0
    for kid in _children(os.getpid()):
        values = status_bytes(kid)
        if values:
            count += 1
            rss += values.get("VmRSS", 0)
            peak = max(peak, values.get("VmHWM", 0))
    return {"children": count, "children_rss": rss, "children_max_hwm": peak}


def limit_bytes() -> int:
    """The bound in bytes from ``$BATON_TEST_RSS_LIMIT_GB``; 0: no bound."""
    raw = os.environ.get(LIMIT_ENV, "").strip()
    return int(float(raw) * _GB) if raw else int(DEFAULT_LIMIT_GB * _GB)


class MemoryGuard:
    """The pytest plugin: see the module's docstring."""

    def __init__(self, limit: int, log: Path | None) -> None:
        self.limit = limit
        self.log = log
        self.enabled = _STATUS.exists() and reset_peak()
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.file: str | None = None
        self.started = 0.0
        self.resident_at_start = 0
        self.over = False

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, Any, Any]:
        if not self.enabled:
            return (yield)
        file = item.nodeid.split("::")[0]
        if file != self.file:
            # A new file: its peak starts here, not at the worst file this process ran before.
            reset_peak()
            self.file, self.started, self.over = file, time.monotonic(), False
            self.resident_at_start = status_bytes().get("VmRSS", 0)
        result = yield
        if nextitem is None or nextitem.nodeid.split("::")[0] != file:
            # The file's fixtures are torn down by now: its peak is final.
            peak = status_bytes().get("VmHWM", 0)
            release_memory(self.resident_at_start)
            self._record(file, peak)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, Any, Any]:
        __tracebackhide__ = True
        result = yield
        trim_heap()
        if not self.enabled or self.limit <= 0 or self.over:
            return result
        peak = status_bytes().get("VmHWM", 0)
        if peak > self.limit:
            # Once per file: the tests after this one would only repeat it.
            self.over = True
            raise MemoryError(
                f"{self.file}: this pytest process ({self.worker}) reached {peak / _GB:.2f} GB "
                f"resident by the end of {item.nodeid}, over the suite's bound of "
                f"{self.limit / _GB:.2f} GB (${LIMIT_ENV}); release engines, models and caches "
                "at the end of the module (tests/memory_guard.py)"
            )
        return result

    def _record(self, file: str, peak: int) -> None:
        if self.log is None:
            return
        values = status_bytes()
        line = {
            "worker": self.worker,
            "pid": os.getpid(),
            "file": file,
            "seconds": round(time.monotonic() - self.started, 2),
            "peak": peak,
            "rss_after": values.get("VmRSS", 0),
            **children_bytes(),
        }
        with open(self.log, "a") as out:
            out.write(json.dumps(line) + "\n")


def register(config: pytest.Config) -> None:
    """Register the guard with pytest (called from conftest's ``pytest_configure``)."""
    log = os.environ.get(LOG_ENV)
    guard = MemoryGuard(limit_bytes(), Path(log) if log else None)
    config.pluginmanager.register(guard, "baton-memory-guard")
