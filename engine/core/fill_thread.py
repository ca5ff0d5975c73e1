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
"""

from __future__ import annotations

import logging
import queue
import threading
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

    def wait(self) -> dict[int, BaseException]:
        """Blocks until every call has returned; the exception each failed call raised, by
        its index in the calls."""
        with self._done:  # released for good by run(), so any number of waits return
            pass
        return self.errors

    def wait_started(self) -> None:
        """Blocks until ``run`` has begun."""
        with self._started:
            pass

    def run(self) -> None:
        """Runs the calls in order on this thread, keeping each one's exception."""
        self._started.release()
        try:
            for i, call in enumerate(self.calls):
                try:
                    call()
                except Exception as exc:  # noqa: BLE001 - returned by wait(); the caller falls back
                    self.errors[i] = exc
        finally:
            self._done.release()


def run_fills(calls: Sequence[NativeFill]) -> PendingFills:
    """Runs ``calls`` here, now; the result is already done."""
    pending = PendingFills(calls)
    pending.run()
    return pending


class FillThread:
    """One daemon thread that runs native fill calls handed to it, one batch at a time.

    Started on first use; ``shutdown`` stops it. Only one thread (the engine's) may call
    ``start``.
    """

    def __init__(self, name: str = "baton-fill") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[PendingFills | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, calls: Sequence[NativeFill]) -> PendingFills:
        """Hands ``calls`` to the thread and returns once it has begun them (see the module
        docstring); ``wait`` on the result before reading the rows they fill.

        Raises:
            RuntimeError: the thread was shut down.
        """
        pending = PendingFills(calls)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        elif not self._thread.is_alive():
            raise RuntimeError("the fill thread was shut down")
        self._jobs.put(pending)
        pending.wait_started()
        return pending

    def shutdown(self) -> None:
        """Stops the thread after the batch it runs; idempotent."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while (pending := self._jobs.get()) is not None:
            pending.run()
