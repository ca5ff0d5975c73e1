"""Where the engine's time goes: per-step CPU phases, device waits and device time."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

_RECENT_STEPS = 4096
_RECENT_SPANS = 65536

# The host phases of a step, as spans record them. "launch" is the time spent handing work
# to the executor (execute_model, sample_tokens: IPC for a worker process), "wait" the time
# blocked in get_output(), "output" the front end's detokenising and output building, "gc"
# the garbage collections the engine runs before it waits (``gc_heap.StepCollector``).
PHASES = ("schedule", "bitmask", "launch", "wait", "update", "output", "gc")
# Each phase's total, by attribute name (spans are added several times a step).
_TOTALS = {phase: "device_wait_s" if phase == "wait" else f"{phase}_s" for phase in PHASES}


class StepRecord(NamedTuple):
    """One engine step: wall time, the CPU phases, the wait and the device time it retired."""

    wall_s: float
    cpu_s: float
    device_wait_s: float
    device_s: float
    deferred: bool


class Span(NamedTuple):
    """One host phase of one step, on the ``time.perf_counter`` clock."""

    phase: str
    start: float
    end: float
    step_id: int


class Phase:
    """A host phase being timed (``EngineStats.phase``): a span from entering the block to
    leaving it, added unless the block raised or ``keep`` was set False. ``step_id`` may be
    set inside the block (a schedule learns its step's id as it ends)."""

    __slots__ = ("_stats", "name", "step_id", "keep", "start", "end")

    def __init__(self, stats: EngineStats, name: str, step_id: int) -> None:
        self._stats = stats
        self.name = name
        self.step_id = step_id
        self.keep = True
        self.start = self.end = 0.0

    def __enter__(self) -> Phase:
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.end = time.perf_counter()
        if exc_type is None and self.keep:
            self._stats.add(self.name, self.start, self.end, self.step_id)


@dataclass
class EngineStats:
    """Totals since the engine started, plus the most recent steps and host spans.

    ``device_busy_fraction`` is the device's forward-and-sample time over
    ``engine_s``: the wall time of engine steps plus the short gaps between
    them where the front end processes outputs (idle periods are not counted).
    """

    steps: int = 0
    deferred_steps: int = 0
    schedule_s: float = 0.0
    bitmask_s: float = 0.0
    launch_s: float = 0.0
    device_wait_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0
    gc_s: float = 0.0
    engine_s: float = 0.0
    device_s: float = 0.0
    # The recent records are kept as plain tuples and named on the way out: the collector
    # stops tracking a plain tuple of numbers and strings at its first pass over it, never a
    # named tuple (a subclass) or a dataclass. Named, the 65,536 spans stayed tracked, and
    # each full collection on the engine thread walked them: at batch 256 on the simulated
    # H200 a full pass grew from 10 to 20 ms over one benchmark run (measured).
    _recent: deque[tuple[float, float, float, float, bool]] = field(
        default_factory=lambda: deque(maxlen=_RECENT_STEPS), init=False, repr=False
    )
    _spans: deque[tuple[str, float, float, int]] = field(
        default_factory=lambda: deque(maxlen=_RECENT_SPANS), init=False, repr=False
    )

    def add(self, phase: str, start: float, end: float, step_id: int = 0) -> None:
        """Adds a host phase's span (``phase`` in ``PHASES``) to its total and the recent spans."""
        name = _TOTALS.get(phase) or f"{phase}_s"
        setattr(self, name, getattr(self, name) + (end - start))
        self._spans.append((phase, start, end, step_id))

    def phase(self, phase: str, step_id: int = 0) -> Phase:
        """Times a block as a host phase of step ``step_id``:
        ``with stats.phase("schedule") as span: ...``; see ``Phase``."""
        return Phase(self, phase, step_id)

    def record(self, wall_s: float, device_wait_s: float, device_s: float, deferred: bool) -> None:
        """Adds one engine step (the phase totals are added by the core as they happen)."""
        self.engine_s += wall_s
        self.device_s += device_s
        cpu = max(0.0, wall_s - device_wait_s)
        self._recent.append((wall_s, cpu, device_wait_s, device_s, deferred))

    def recent_steps(self) -> list[StepRecord]:
        """The most recent steps (at most 4,096), oldest first."""
        return [StepRecord._make(r) for r in self._recent]

    def recent_spans(self, since: float = float("-inf")) -> list[Span]:
        """The most recent host spans (at most 65,536) that start at or after ``since``
        (``time.perf_counter``), oldest first."""
        return [Span._make(s) for s in self._spans if s[1] >= since]

    def clear_recent(self) -> None:
        """Forgets the recent steps and spans (the totals stay): a caller measuring one run
        clears them first so that the recent ones are exactly that run's."""
        self._recent.clear()
        self._spans.clear()

    def as_dict(self) -> dict[str, float | int]:
        busy = self.device_s / self.engine_s if self.engine_s > 0 else 0.0
        return {
            "steps": self.steps,
            "deferred_steps": self.deferred_steps,
            "device_busy_fraction": min(1.0, busy),
            "schedule_s": self.schedule_s,
            "bitmask_s": self.bitmask_s,
            "launch_s": self.launch_s,
            "device_wait_s": self.device_wait_s,
            "update_s": self.update_s,
            "output_s": self.output_s,
            "gc_s": self.gc_s,
            "engine_s": self.engine_s,
            "device_s": self.device_s,
        }
