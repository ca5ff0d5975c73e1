"""``ThreadGovernor``: fewer torch threads while other processes keep this machine's cores busy.

torch's OpenMP threads wait for each other at every barrier of a forward. While another
process holds one of the cores they run on, every barrier waits out that process's time
slice: measured on this 2-core machine (the default model, float32, in this process), a
``while 1: pass`` process beside the engine made decode 3-8x slower with 2 threads
(batch 1: 27.9 -> 9.2 tok/s; batch 16: 216 -> 14 tok/s) while 1 thread kept its quiet speed
(17.5 / 126 tok/s). With partial load the crossover sat near half a core: a process busy 25%
of the time left 2 threads ahead at batch 16 (149 vs 117 tok/s), 50% made them even
(124 / 128), 75% put 1 thread ahead (87 / 128). So the governor measures, every
``period_s`` of steps, how many cores the rest of the machine kept busy and runs
``floor(cores - others + 0.6)`` threads (at least 1, at most what the thread started with):
it changes the count only after ``settle`` readings in a row asked for a change the same
way. Readings cover only time this process spent stepping: after an idle gap between steps
the next reading starts afresh, and a reading in which this process computed less than
``_MIN_OWN_SHARE`` of a core is not judged (what others did while this one waited says
nothing about the cores while it computes).

The reading is Linux's ``/proc/stat`` (busy time of the cores this process may run on, all
processes, steal included) minus this process's CPU time; without ``/proc/stat`` the
governor does nothing. It must be called on the thread that runs the forwards: torch's
thread count is per calling thread.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.engine.config import num_cpu_cores

logger = logging.getLogger(__name__)

# Where the extra threads stop paying (see the module docstring): half a core of others' load
# made 1 and 2 threads even, so a thread is dropped from 0.6 of a core of others' load on.
_KEEP_BELOW = 0.6
# A reading counts only if this process computed at least this share of a core during it.
_MIN_OWN_SHARE = 0.3
# A time between steps this many times their moving average (and over _MIN_IDLE_S) is idle.
# Not "over period_s": the benchmark's runs on the tiny model last ~0.4 s, so a reading could
# still span the other engine's whole run.
_IDLE_GAPS = 10.0
_MIN_IDLE_S = 0.1
_GAP_WEIGHT = 0.2


@dataclass(frozen=True)
class CpuReading:
    """One reading of the clocks the governor compares (seconds)."""

    wall: float  # monotonic
    busy: float  # CPU time spent on this process's cores by every process, since boot
    own: float  # this process's CPU time (all its threads), plus its partners'


@dataclass(frozen=True)
class ThreadState:
    """What a governor has done: the torch threads now, at most, and how often it changed."""

    threads: int
    max_threads: int
    changes: int
    others_cores: float  # cores the rest of the machine kept busy at the last reading


def read_cpu(
    cores: frozenset[int] | None = None, partners: tuple[int, ...] = ()
) -> CpuReading | None:
    """Reads ``/proc/stat`` for ``cores`` (default: those this process may run on) and the CPU
    time of this process plus its ``partners`` (process ids whose work is this one's own: the
    engine process, for the model worker that computes for it; one that is gone counts 0).
    Returns None where ``/proc/stat`` cannot be read or parsed."""
    if cores is None:
        cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    busy_ticks = 0
    seen = 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            index = int(name[3:])
            values = [int(v) for v in fields[:8]]
        except ValueError:
            return None
        if (cores is not None and index not in cores) or len(values) < 8:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = values
        busy_ticks += user + nice + system + irq + softirq + steal
        seen += 1
    if seen == 0:
        return None
    ticks = _ticks_per_second()
    own = time.process_time() + sum(_process_ticks(pid) for pid in partners) / ticks
    return CpuReading(time.monotonic(), busy_ticks / ticks, own)


def _process_ticks(pid: int) -> int:
    """User + system clock ticks of process ``pid`` so far (0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The name (field 2) may hold spaces; utime and stime are fields 14 and 15.
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def _ticks_per_second() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


class ThreadGovernor:
    """Adjusts the calling thread's torch thread count to the cores others leave free.

    Call ``before_step()`` on the thread that runs the forwards, before each one; it reads
    the clocks at most once per ``period_s`` (``read``'s ``wall`` and ``clock`` are the same
    clock) and calls ``set_threads`` only on a change (logged at INFO). ``max_threads``
    defaults to the calling thread's torch thread count at the first call; with 1 the governor
    never reads anything. ``settle`` readings in a row must agree before a change.
    """

    def __init__(
        self,
        max_threads: int | None = None,
        *,
        cores: int | None = None,
        read: Callable[[], CpuReading | None] = read_cpu,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        get_threads: Callable[[], int] = torch.get_num_threads,
        clock: Callable[[], float] = time.monotonic,
        period_s: float = 0.5,
        settle: int = 2,
    ) -> None:
        if period_s <= 0 or settle < 1:
            raise ValueError("period_s must be > 0 and settle >= 1")
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._max = max_threads
        self._cores = cores
        self._read, self._set, self._get, self._clock = read, set_threads, get_threads, clock
        self._period = period_s
        self._settle = settle
        self._threads = 0  # 0: not started (the first before_step starts it)
        self._last: CpuReading | None = None
        self._streak = 0  # readings in a row that asked for a change the same way
        self._changes = 0
        self._others = 0.0
        self._off = False
        self._prev_call = 0.0  # clock at the last before_step
        self._gap = 0.0  # moving average of the time between steps

    def before_step(self) -> None:
        """Reads the clocks if ``period_s`` has passed since the last reading and changes the
        thread count if the load says so. Cheap otherwise (one clock read)."""
        if self._off:
            return
        if self._threads == 0:
            self._start()
            return
        t = self._clock()
        gap, self._prev_call = t - self._prev_call, t
        idle = self._gap > 0 and gap > max(_MIN_IDLE_S, _IDLE_GAPS * self._gap)
        # Clipped, so an idle gap barely moves the average but steps that stay 10x longer
        # (a phase of big batches) pull it up within a few steps.
        seen = min(gap, _IDLE_GAPS * self._gap) if self._gap > 0 else gap
        self._gap += _GAP_WEIGHT * (seen - self._gap) if self._gap > 0 else seen
        if idle:
            # Back from idle (between requests): the next reading starts here, so it never
            # spans what others did while this process waited. Seen in a benchmark that keeps
            # two engines: each one's first reading spanned the other's run.
            self._rebase()
            return
        last = self._last
        assert last is not None
        if t - last.wall < self._period:
            return
        now = self._read()
        if now is None:
            self._off = True
            return
        self._last = now
        wall = now.wall - last.wall
        if wall <= 0:
            return
        own = now.own - last.own
        if own < _MIN_OWN_SHARE * wall:
            return  # mostly waiting (e.g. on the engine process): nothing to judge
        self._others = max(0.0, (now.busy - last.busy) - own) / wall
        self._decide(self._target(self._others))

    def state(self) -> ThreadState:
        """The thread count now and since start (``threads`` is 0 before the first step)."""
        return ThreadState(self._threads, self._max or 0, self._changes, round(self._others, 2))

    def _start(self) -> None:
        if self._max is None:
            self._max = max(1, self._get())
        if self._cores is None:
            self._cores = num_cpu_cores()
        self._threads = self._max
        self._set(self._threads)
        self._off = self._max == 1
        if not self._off:
            self._prev_call = self._clock()
            self._rebase()

    def _rebase(self) -> None:
        self._last = self._read()
        self._off = self._last is None

    def _target(self, others: float) -> int:
        assert self._max is not None and self._cores is not None
        return max(1, min(self._max, math.floor(self._cores - others + _KEEP_BELOW)))

    def _decide(self, target: int) -> None:
        way = (target > self._threads) - (target < self._threads)
        if way == 0:
            self._streak = 0
            return
        self._streak = self._streak + way if self._streak * way > 0 else way
        if abs(self._streak) >= self._settle:
            self._streak = 0
            self._change(target)

    def _change(self, threads: int) -> None:
        logger.info(
            "torch threads %d -> %d: other processes kept %.2f of %d cores busy",
            self._threads,
            threads,
            self._others,
            self._cores,
        )
        self._threads = threads
        self._changes += 1
        self._set(threads)
