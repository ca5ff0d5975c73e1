"""Host time a model runner spends in each part of its calls, for finding where a step goes.

On the H200 the engine's "launch" phase (queueing a step's forward and sampling) took 2.3-3.3 ms
a step at batch 32 while the GPU's kernels ran 1.2 ms; a profiler inflates that Python time, so
the runner can instead keep plain clock laps of its own parts. Off unless ``BATON_RUNNER_TIMES=1``
is set when the runner is built; off, a lap costs one attribute test.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

RUNNER_TIMES_ENV = "BATON_RUNNER_TIMES"


class HostTimes:
    """Accumulates host seconds per named part: ``start`` at the top of a call, ``lap(name)``
    after each part (the time since the last start or lap goes to ``name``)."""

    def __init__(self, enabled: bool | None = None) -> None:
        """``enabled``: None reads ``BATON_RUNNER_TIMES`` ("1": on)."""
        self.enabled = os.environ.get(RUNNER_TIMES_ENV) == "1" if enabled is None else enabled
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._last = 0.0

    def start(self) -> None:
        """Begins timing a call."""
        if self.enabled:
            self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """Adds the time since the last ``start`` or ``lap`` to ``name``."""
        if self.enabled:
            now = time.perf_counter()
            self._seconds[name] += now - self._last
            self._last = now

    def snapshot(self) -> dict[str, float]:
        """Seconds per part so far (empty when off)."""
        return dict(self._seconds)
