"""StepCollector: automatic garbage collection held off inside engine steps, run at the waits."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from baton.engine.gc_heap import StepCollector


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A reference cycle only the collector frees; a weak reference to watch it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _gc_restored() -> Iterator[None]:
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()


def test_deferred_holds_collection_off_and_restores_it() -> None:
    gc.enable()
    collector = StepCollector()
    with collector.deferred():
        assert not gc.isenabled()
        with collector.deferred():  # nested (a step inside a step's caller): still off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector.deferred():
        raise RuntimeError("a failed step")
    assert gc.isenabled()


def test_a_process_that_turned_collection_off_keeps_it_off() -> None:
    gc.disable()
    gc.collect()
    collector = StepCollector()
    gc.set_threshold(1)
    with collector.deferred():
        ref = _cycle()
        assert not collector.collect_if_due()
        assert ref() is not None
    assert not gc.isenabled()
    gc.collect()
    assert ref() is None


def test_collects_at_the_wait_once_the_young_generation_is_due() -> None:
    gc.enable()
    gc.collect()
    collector = StepCollector()
    gc.set_threshold(100_000)
    with collector.deferred():
        ref = _cycle()
        assert not collector.collect_if_due()  # far below the threshold: nothing yet
        assert ref() is not None
        gc.set_threshold(1)
        _cycle()  # past the threshold of 1 whatever the count was
        assert collector.collect_if_due()
        assert ref() is None
    assert collector.passes == 1
    assert not collector.collect_if_due()  # outside a step the interpreter collects itself


def test_older_generations_follow_their_thresholds() -> None:
    gc.enable()
    gc.collect()
    collector = StepCollector()
    with collector.deferred():
        gc.set_threshold(1, 2, 1_000_000)
        gc.collect()
        counts = []
        for _ in range(4):
            _cycle()
            assert collector.collect_if_due()
            counts.append(gc.get_count()[1:])
    # Young passes count up in the middle generation; once its count exceeds its threshold
    # the next pass collects it too.
    assert counts == [(1, 0), (2, 0), (3, 0), (0, 1)]


def test_a_full_pass_waits_until_the_oldest_generation_grew_by_a_quarter() -> None:
    """The interpreter's own condition for a full pass, which the collector keeps: passes
    due by the counts alone collect the middle generation instead."""
    gc.enable()
    gc.collect()
    collector = StepCollector()

    def run_passes(n: int) -> None:
        for _ in range(n):
            _cycle()
            assert collector.collect_if_due()

    with collector.deferred():
        gc.set_threshold(1, 1, 1)
        run_passes(20)
        assert collector.full_passes == 1  # the first full pass follows the counts
        run_passes(30)  # due by the counts several times over; garbage dies young
        assert collector.full_passes == 1
        survivors = [_Node() for _ in range(len(gc.get_objects()) // 2)]
        run_passes(10)  # promoted to the oldest generation: a full pass follows
        assert collector.full_passes == 2
        ref = _cycle()
        run_passes(10)
        assert ref() is None
    assert len(survivors) > 0
