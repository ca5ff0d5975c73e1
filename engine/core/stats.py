"""Where the engine's time goes: per-step CPU phases, device waits and device time."""

from __future__ import annotations

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


class StepRecord(NamedTuple):
    """One engine step: wall time, the CPU phases, the wait and the device time it retired.

    This and ``Span`` are named tuples: the collector stops tracking a tuple of numbers, while
    every frozen dataclass in the engine's 65,536 recent spans stayed tracked, and a full
    collection walked them all (8 ms pauses on the engine thread at batch 256, measured)."""

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
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=_RECENT_STEPS))
    spans: deque[Span] = field(default_factory=lambda: deque(maxlen=_RECENT_SPANS))

    def add(self, phase: str, start: float, end: float, step_id: int = 0) -> None:
        """Adds a host phase's span (``phase`` in ``PHASES``) to its total and the recent spans."""
        name = "device_wait_s" if phase == "wait" else f"{phase}_s"
        setattr(self, name, getattr(self, name) + (end - start))
        self.spans.append(Span(phase, start, end, step_id))

    def record(self, wall_s: float, device_wait_s: float, device_s: float, deferred: bool) -> None:
        """Adds one engine step (the phase totals are added by the core as they happen)."""
        self.engine_s += wall_s
        self.device_s += device_s
        cpu = max(0.0, wall_s - device_wait_s)
        self.recent.append(StepRecord(wall_s, cpu, device_wait_s, device_s, deferred))

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
