"""The fill thread: native bitmask fills beside the engine thread's Python work."""

from __future__ import annotations

import threading

import pytest

from baton.engine.core.fill_thread import FillGovernor, FillThread, run_fills


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


def test_the_governor_pauses_the_thread_after_a_window_that_hid_too_little() -> None:
    gov = FillGovernor(window=2, max_held=0.5, pause=3)
    assert gov.use_thread()
    gov.record(native_s=0.2, held_s=0.21)  # the engine thread got nothing back
    assert gov.use_thread()  # half a window: no verdict yet
    gov.record(native_s=0.2, held_s=0.19)
    assert [gov.use_thread() for _ in range(4)] == [False, False, False, True]


def test_the_governor_ends_a_window_early_once_the_thread_held_more_than_it_hid() -> None:
    gov = FillGovernor(window=32, max_held=0.5, pause=3, min_fills=4)
    for _ in range(3):  # fewer than min_fills: no verdict, however bad
        assert gov.use_thread()
        gov.record(native_s=0.2, held_s=2.0)
    assert gov.use_thread()
    gov.record(native_s=0.2, held_s=2.0)  # the 4th: held 8 s of 0.8 s native, thread lost
    assert [gov.use_thread() for _ in range(4)] == [False, False, False, True]


def test_the_governor_judges_a_thread_that_held_less_than_the_fill_over_a_whole_window() -> None:
    gov = FillGovernor(window=8, max_held=0.5, pause=3, min_fills=4)
    for _ in range(7):  # held 0.8 of the native time: above max_held, not lost outright
        assert gov.use_thread()
        gov.record(native_s=0.2, held_s=0.16)
    assert gov.use_thread()
    gov.record(native_s=0.2, held_s=0.16)
    assert [gov.use_thread() for _ in range(4)] == [False, False, False, True]


def test_the_governor_keeps_a_thread_that_hides_the_fill() -> None:
    gov = FillGovernor(window=2, max_held=0.5, pause=3)
    for _ in range(10):
        assert gov.use_thread()
        gov.record(native_s=0.2, held_s=0.03)  # only the hand-off held the engine thread
    # A window exactly at the bound is kept: the thread must hide more than half to stay,
    # and fewer than half held is a gain.
    gov.record(native_s=0.2, held_s=0.1)
    gov.record(native_s=0.2, held_s=0.1)
    assert gov.use_thread()


def test_the_governor_refuses_settings_that_cannot_work() -> None:
    for kwargs in ({"window": 0}, {"max_held": 0.0}, {"pause": -1}, {"min_fills": 0}):
        with pytest.raises(ValueError, match="bad governor settings"):
            FillGovernor(**kwargs)  # type: ignore[arg-type]


def test_the_thread_reports_each_finished_fill_to_its_governor() -> None:
    filler = FillThread(governor=FillGovernor(window=1, max_held=0.5, pause=2))
    try:
        assert filler.worthwhile()
        pending = filler.start([lambda: None])
        pending.wait()
        assert pending.native_s >= 0.0 and pending.held_s >= 0.0
        # As on a host whose cores are all busy: the engine thread was held the whole fill.
        pending.native_s, pending.held_s = 1.0, 1.0
        assert [filler.worthwhile() for _ in range(3)] == [False, False, True]
        # Each fill is reported once.
        assert filler.worthwhile()
    finally:
        filler.shutdown()
