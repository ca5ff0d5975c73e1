"""The native part of a step's bitmask fill, on a thread beside the engine thread.

Under async scheduling a deferred step's bitmask waits for the previous step's tokens, and
the engine thread then also plans the step after it. The fill's native calls (xgrammar's and
llguidance's batched fills) release the GIL, so they can run here while the engine thread
schedules in Python; only the Python side of the fill (``GrammarBackend.plan_fill``) stays on
the engine thread.

The hand-off waits until this thread has begun the first call: a thread that wakes while
another runs Python waits up to the interpreter's switch interval (5 ms) for the GIL, far
longer than the fill; holding the engine thread until then means this thread takes the GIL
at once and gives it back as the native call starts.

The thread pays only where a second core is free for it. On a host whose other cores are
busy (a 2-core machine beside another process) the engine thread, woken on the fill's core,
gets it back only when the fill ends: measured on the simulated H200 at batch 32, all JSON,
the engine thread was held 0.21 ms of each step's 0.19 ms fill, and the hand-off made steps
about 0.1 ms slower than filling on the engine thread. ``FillGovernor`` watches how much of
the native time the engine thread really got back and turns the thread off while it gains
nothing, trying it again now and then.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from baton.grammar.backend import NativeFill

logger = logging.getLogger(__name__)


class PendingFills:
    """Native fill calls started on a ``FillThread`` (or already run); ``wait`` for them."""

    def __init__(self, calls: Sequence[NativeFill]) -> None:
        self.calls = tuple(calls)
        self.errors: dict[int, BaseException] = {}
        # Plain locks held until the moment they stand for, not Events: one PendingFills is
        # made per step, and an Event (a Condition and its locks) costs several times as much
        # to make, set and wait for.
        self._started = threading.Lock()
        self._started.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        # Seconds the calls ran, and seconds the engine thread was held by the hand-off
        # and by ``wait``: what ``FillGovernor`` weighs.
        self.native_s = 0.0
        self.held_s = 0.0

    def wait(self) -> dict[int, BaseException]:
        """Blocks until every call has returned; the exception each failed call raised, by
        its index in the calls."""
        t0 = time.perf_counter()
        with self._done:  # released for good by run(), so any number of waits return
            pass
        self.held_s += time.perf_counter() - t0
        return self.errors

    def done(self) -> bool:
        """True once every call has returned."""
        return not self._done.locked()

    def wait_started(self) -> None:
        """Blocks until ``run`` has begun."""
        with self._started:
            pass

    def run(self) -> None:
        """Runs the calls in order on this thread, keeping each one's exception."""
        self._started.release()
        t0 = time.perf_counter()
        try:
            for i, call in enumerate(self.calls):
                try:
                    call()
                except Exception as exc:  # noqa: BLE001 - returned by wait(); the caller falls back
                    self.errors[i] = exc
        finally:
            self.native_s = time.perf_counter() - t0
            self._done.release()


def run_fills(calls: Sequence[NativeFill]) -> PendingFills:
    """Runs ``calls`` here, now; the result is already done."""
    pending = PendingFills(calls)
    pending.run()
    return pending


class FillGovernor:
    """Decides, fill by fill, whether the fill thread is worth its hand-off.

    Over each ``window`` of fills on the thread it adds up the native calls' seconds and
    the seconds the engine thread was held anyway (hand-off and wait). Held for more than
    ``max_held`` of the native time, the thread hid too little of the fill to pay for the
    hand-off: the next ``pause`` fills run on the engine thread, then the thread is tried
    again for a window. A window ends early, after ``min_fills`` fills, once they held the
    engine thread longer than their native time (the thread cannot pay any more). Where
    cores are free the engine thread is held for the hand-off only, a small share of any
    sizeable fill, and the thread stays on. Pure bookkeeping of the times it is given, so
    its decisions are testable without a clock.
    """

    def __init__(
        self, window: int = 32, max_held: float = 0.5, pause: int = 512, min_fills: int = 4
    ) -> None:
        if window < 1 or pause < 0 or max_held <= 0.0 or min_fills < 1:
            raise ValueError(
                f"bad governor settings: {window=}, {max_held=}, {pause=}, {min_fills=}"
            )
        self.window = window
        self.min_fills = min_fills
        self.max_held = max_held
        self.pause = pause
        self._fills = 0
        self._native_s = 0.0
        self._held_s = 0.0
        self._paused = 0

    def use_thread(self) -> bool:
        """Whether the next fill should go to the thread (False: fill on the engine thread,
        which counts down the pause)."""
        if self._paused:
            self._paused -= 1
            return False
        return True

    def record(self, native_s: float, held_s: float) -> None:
        """Adds one fill run on the thread: its native seconds, and the seconds the engine
        thread was held by it."""
        self._fills += 1
        self._native_s += native_s
        self._held_s += held_s
        # A window whose first fills held the engine thread longer than their whole native
        # time ends there: the thread already lost, and each more fill handed to it costs a
        # wake-up on a busy core (measured on a loaded 2-core host: 2.3 ms of wall time a
        # hand-off for a 0.2 ms fill, a whole window 0.2 ms a step over 544 steps).
        lost = self._fills >= self.min_fills and self._held_s > self._native_s
        if self._fills < self.window and not lost:
            return
        if self._held_s > self.max_held * self._native_s:
            self._paused = self.pause
        self._fills, self._native_s, self._held_s = 0, 0.0, 0.0


class FillThread:
    """One daemon thread that runs native fill calls handed to it, one batch at a time.

    Started on first use; ``shutdown`` stops it. Only one thread (the engine's) may call
    ``start``. ``worthwhile`` says whether the next fill should use it (``FillGovernor``).
    """

    def __init__(self, name: str = "baton-fill", governor: FillGovernor | None = None) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[PendingFills | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.governor = governor or FillGovernor()
        self._last: PendingFills | None = None

    def worthwhile(self) -> bool:
        """Whether the caller should hand its next fill to ``start`` rather than fill on its
        own thread: False while recent fills here hid too little of their native time."""
        last = self._last
        if last is not None and last.done():
            self.governor.record(last.native_s, last.held_s)
            self._last = None
        return self.governor.use_thread()

    def start(self, calls: Sequence[NativeFill]) -> PendingFills:
        """Hands ``calls`` to the thread and returns once it has begun them (see the module
        docstring); ``wait`` on the result before reading the rows they fill.

        Raises:
            RuntimeError: the thread was shut down.
        """
        t0 = time.perf_counter()
        pending = PendingFills(calls)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        elif not self._thread.is_alive():
            raise RuntimeError("the fill thread was shut down")
        self._jobs.put(pending)
        pending.wait_started()
        pending.held_s += time.perf_counter() - t0
        self._last = pending
        return pending

    def shutdown(self) -> None:
        """Stops the thread after the batch it runs; idempotent."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while (pending := self._jobs.get()) is not None:
            pending.run()
