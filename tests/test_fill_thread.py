"""The fill thread: native bitmask fills beside the engine thread's Python work."""

from __future__ import annotations

import threading

import pytest

from baton.engine.core.fill_thread import FillThread, run_fills


def test_start_returns_while_the_call_still_runs_on_another_thread() -> None:
    filler = FillThread()
    release = threading.Event()
    seen: list[int] = []

    def call() -> None:
        seen.append(threading.get_ident())
        # Blocks (without the GIL) until the engine thread, back from start(), releases it:
        # a start() that waited for the call to end would never return.
        assert release.wait(timeout=30)

    try:
        pending = filler.start([call])
        release.set()
        assert pending.wait() == {}
        assert seen and seen[0] != threading.get_ident()
    finally:
        filler.shutdown()


def test_errors_come_back_by_index_and_the_later_calls_still_run() -> None:
    filler = FillThread()
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("planted native fill failure")

    try:
        errors = filler.start([lambda: ran.append("a"), boom, lambda: ran.append("c")]).wait()
        assert ran == ["a", "c"]
        assert list(errors) == [1] and "planted" in str(errors[1])
        # The thread lives on for the next step.
        assert filler.start([lambda: ran.append("d")]).wait() == {}
        assert ran[-1] == "d"
    finally:
        filler.shutdown()


def test_shutdown_is_idempotent_and_a_later_start_fails_clearly() -> None:
    filler = FillThread()
    filler.shutdown()  # never started: nothing to stop
    assert filler.start([lambda: None]).wait() == {}
    filler.shutdown()
    filler.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        filler.start([lambda: None])


def test_run_fills_runs_the_calls_here_and_keeps_their_errors() -> None:
    here = threading.get_ident()
    seen: list[int] = []

    def boom() -> None:
        raise ValueError("bad row")

    pending = run_fills([lambda: seen.append(threading.get_ident()), boom])
    assert seen == [here]
    assert isinstance(pending.wait()[1], ValueError)
