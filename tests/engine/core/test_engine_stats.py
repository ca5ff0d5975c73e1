"""EngineStats: totals, the recent steps and spans as named records, and records that the
garbage collector does not have to walk."""

from __future__ import annotations

import gc

from baton.engine.core.stats import EngineStats, Span, StepRecord


def test_recent_records_come_back_named_and_in_order() -> None:
    stats = EngineStats()
    stats.add("schedule", 1.0, 1.5, step_id=7)
    stats.add("wait", 2.0, 2.25, step_id=7)
    stats.record(wall_s=1.0, device_wait_s=0.25, device_s=0.8, deferred=False)
    assert stats.schedule_s == 0.5 and stats.device_wait_s == 0.25
    assert stats.recent_spans() == [Span("schedule", 1.0, 1.5, 7), Span("wait", 2.0, 2.25, 7)]
    assert stats.recent_spans(since=1.9) == [Span("wait", 2.0, 2.25, 7)]
    assert stats.recent_steps() == [StepRecord(1.0, 0.75, 0.25, 0.8, False)]
    stats.clear_recent()
    assert stats.recent_spans() == [] and stats.recent_steps() == []
    assert stats.schedule_s == 0.5  # the totals stay


def test_recorded_steps_leave_nothing_for_the_collector_to_walk() -> None:
    """A long-running engine keeps 65,536 spans; each full collection on the engine thread
    would walk every one of them if they stayed tracked (named tuples do)."""
    stats = EngineStats()
    gc.collect()
    before = len(gc.get_objects())
    for i in range(5000):
        stats.add("update", float(i), i + 0.5, step_id=i)
        stats.record(wall_s=1.0, device_wait_s=0.1, device_s=0.9, deferred=bool(i % 2))
    gc.collect()
    assert len(gc.get_objects()) - before < 500
    assert len(stats.recent_spans()) == 5000


def test_a_phase_block_adds_its_span_unless_it_raised_or_was_dropped() -> None:
    stats = EngineStats()
    with stats.phase("schedule") as span:
        span.step_id = 3  # a schedule learns its step's id as it ends
    with stats.phase("gc", 3) as collected:
        collected.keep = False  # nothing was collected
    try:
        with stats.phase("launch", 4):
            raise RuntimeError("the executor failed")
    except RuntimeError:
        pass
    (recorded,) = stats.recent_spans()
    assert recorded == Span("schedule", span.start, span.end, 3)
    assert span.start <= span.end and stats.schedule_s == span.end - span.start
    assert stats.gc_s == 0.0 and stats.launch_s == 0.0
