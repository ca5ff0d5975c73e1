"""The engine core: schedule, forward, bitmask, sample, update; synchronous or one step ahead.

With async scheduling the step in flight is a value handed from one call to the next
(mini-sglang's ``overlap_loop(last) -> ongoing``): ``step(last)`` plans and queues step N+1,
then waits for step N (``last``) and applies its tokens, and returns N+1 as the step now in
flight. Failures come back as outputs of the call that found them.

A step whose structured requests still wait for step N's tokens (deferred) is handed on
with its forward queued and its sampling not: the next call applies step N's tokens, fills
the step's bitmask, plans the step after it, and then queues the sampling and that next
forward back to back. So the device runs forward after sampling after forward with no host
gap between them, and output processing and scheduling overlap a forward instead of
standing between a sampling and the next forward. Without a drafter the grammars take step
N's tokens first, and the fill's native part runs on a fill thread beside the rest of the
update and the planning.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from baton.engine.core.draft_policy import decode_rows
from baton.engine.core.fill_thread import FillThread
from baton.engine.core.request import Request, RequestStatus
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.stats import EngineStats
from baton.engine.core.structured_outputs import BitmaskInProgress
from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.gc_heap import StepCollector
from baton.engine.scheduler_output import (
    EngineCoreOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.engine.sync_check import SyncChecker

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002
# A longer gap between two steps is idle time, not part of the engine's work.
_MAX_FRONT_END_GAP_S = 0.05

Outputs = list[EngineCoreOutput]


@dataclass(frozen=True)
class SampledStep:
    """A step queued on the device (forward and sampling) whose tokens are not applied yet."""

    so: SchedulerOutput
    output: AsyncOutput


@dataclass(frozen=True)
class InFlight:
    """What the async loop leaves on the device between two calls: the last step whose
    sampling is queued (``sampled``) and, when the step after it was deferred, that step
    (``unsampled``: its forward is queued, its sampling waits for ``sampled``'s tokens)."""

    sampled: SampledStep | None
    unsampled: SchedulerOutput | None = None


class EngineCore:
    """Drives the scheduler and an executor, one ``step`` per call."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        async_scheduling: bool = False,
        checker: SyncChecker | None = None,
        fill_thread: bool = True,
    ) -> None:
        if async_scheduling and not executor.supports_async_scheduling():
            raise ValueError(f"{type(executor).__name__} does not support async scheduling")
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.checker = checker or SyncChecker("off")
        self.stats = EngineStats()
        self._dead: str | None = None
        self._last_step_end: float | None = None
        # When the last step's tokens arrived (None after idling): the time to the next
        # arrival is that step's cost, which the scheduler's draft policy weighs.
        self._last_arrival: float | None = None
        # A deferred step's fill overlaps the update and scheduling the next one (async only;
        # never with drafters, which read matchers while scheduling).
        overlap = fill_thread and async_scheduling and scheduler.fills_beside_schedule()
        self._filler = FillThread() if overlap else None
        self._gc = StepCollector()

    def add_request(self, request: Request) -> None:
        if self._dead is not None:
            raise ExecutorError(f"the engine cannot run requests any more: {self._dead}")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finishes requests as aborted and frees their KV blocks; unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def failure(self) -> str | None:
        """Why this core can no longer run steps (its executor failed), or None while it can.
        Reads only flags, so any thread may call it."""
        return self._dead or self.executor.failure()

    def idle_work(self) -> bool:
        """One slice of the executor's idle-time work (``Executor.idle_work``); whether any
        remains. Call only while no step is in flight."""
        return self.executor.idle_work()

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running (a step in flight is the caller's to know of)."""
        return self.scheduler.has_unfinished_requests()

    def step(self, last: InFlight | None = None) -> tuple[Outputs, InFlight | None]:
        """One step in the configured mode: what each request got, and the step now in flight.

        With async scheduling pass the step the previous call returned as ``last``; a
        synchronous step leaves nothing in flight. An executor failure fails every request
        (their error outputs are returned) and drops the step in flight.
        """
        t0 = time.perf_counter()
        if self._last_step_end is not None and t0 - self._last_step_end < _MAX_FRONT_END_GAP_S:
            # Front-end work between steps (detokenising) overlaps the device too.
            self.stats.engine_s += t0 - self._last_step_end
        else:
            self._last_arrival = None  # the engine idled: the next interval is no step's
        wait0, device0 = self.stats.device_wait_s, self.executor.device_seconds
        deferred0 = self.stats.deferred_steps
        try:
            with self.checker.guard(), self._gc.deferred():
                if self.async_scheduling:
                    outputs, ongoing = self._overlap_step(last)
                else:
                    outputs, ongoing = self._sync_step(), None
        except ExecutorError as exc:
            return self._fail_all(str(exc)), None
        self.stats.record(
            time.perf_counter() - t0,
            self.stats.device_wait_s - wait0,
            self.executor.device_seconds - device0,
            self.stats.deferred_steps > deferred0,
        )
        self._last_step_end = time.perf_counter()
        return outputs, ongoing

    # ------------------------------------------------------------------ modes
    def _sync_step(self) -> Outputs:
        outputs = self.scheduler.poll_grammars()
        if not self.scheduler.has_unfinished_requests():
            return outputs
        so = self._schedule()
        if not _has_work(so):
            return outputs + self._idle()
        self._execute(so)
        step, failed = self._queue_sampling(so)
        return [*outputs, *failed, *self._update(step)]

    def _overlap_step(self, last: InFlight | None) -> tuple[Outputs, InFlight | None]:
        outputs = self.scheduler.poll_grammars()
        sampled = None if last is None else last.sampled
        ready: tuple[SchedulerOutput, GrammarOutput | None] | None = None
        if last is not None and last.unsampled is not None:
            # The deferred step's grammars wait for these tokens; its forward is running.
            assert sampled is not None, "InFlight defers a step only behind a sampled one"
            # Never with a drafter, so the step has no drafts.
            if self._filler is not None and self._filler.worthwhile():
                # The grammars take step N's tokens first; the fill's native part then runs
                # on the fill thread beside the rest of the update and the next schedule.
                applied, started = self._update_filling(sampled, last.unsampled, self._filler)
                outputs += applied
                so = self._schedule() if self.scheduler.has_unfinished_requests() else None
                bitmask, failed = self._finish_fill(last.unsampled, started)
            else:
                outputs += self._update(sampled)
                bitmask, failed = self._fill(last.unsampled)
                so = self._schedule() if self.scheduler.has_unfinished_requests() else None
            sampled = None
            outputs += failed
            ready = (last.unsampled, bitmask)
        else:
            so = self._schedule() if self.scheduler.has_unfinished_requests() else None
        if ready is not None:  # its sampling, then the next forward, back to back
            sampled = self._sample(*ready)
        if so is None or not _has_work(so):
            if sampled is None:
                return outputs + (self._idle() if so is not None else []), None
            if ready is not None:
                # Step N's tokens are applied: return them now and leave the deferred step
                # in flight. Waiting for it here held back the last token of a request that
                # stopped in step N (the row after a stop is wasted) by one whole forward.
                return outputs, InFlight(sampled)
            return outputs + self._update(sampled), None
        self._execute(so)  # step N+1's forward is queued behind step N
        if so.pending_structured_output_tokens and sampled is not None:
            # A grammar in it waits for step N's token (with no step in flight there is
            # nothing to wait for: a placeholder count gone stale must not stall it).
            self.stats.deferred_steps += 1
            return outputs, InFlight(sampled, so)
        ongoing, failed = self._queue_sampling(so)  # the bitmask overlaps the forwards
        outputs += failed
        if sampled is not None:
            outputs += self._update(sampled)
        return outputs, InFlight(ongoing)

    # ---------------------------------------------------------------- phases
    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.stats.add("schedule", t0, time.perf_counter(), so.step_id)
        if not so.is_empty:
            self.stats.steps += 1
        return so

    def _execute(self, so: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        self.executor.execute_model(so)
        self.stats.add("launch", t0, time.perf_counter(), so.step_id)

    def _queue_sampling(self, so: SchedulerOutput) -> tuple[SampledStep, Outputs]:
        """Fills the step's bitmask and queues its sampling; returns the step in flight and
        the requests that failed in the fill."""
        grammar, failed = self._fill(so)
        return self._sample(so, grammar), failed

    def _fill(self, so: SchedulerOutput) -> tuple[GrammarOutput | None, Outputs]:
        """The step's grammar bitmask, and the requests that failed in the fill."""
        t0 = time.perf_counter()
        grammar, failed = self.scheduler.get_grammar_bitmask(so, self.executor.bitmask_buffer())
        self.stats.add("bitmask", t0, time.perf_counter(), so.step_id)
        return grammar, failed

    def _start_fill(self, so: SchedulerOutput, filler: FillThread) -> BitmaskInProgress | None:
        """Starts the step's bitmask fill with its native part on ``filler``'s thread."""
        t0 = time.perf_counter()
        started = self.scheduler.start_grammar_bitmask(so, self.executor.bitmask_buffer(), filler)
        self.stats.add("bitmask", t0, time.perf_counter(), so.step_id)
        return started

    def _finish_fill(
        self, so: SchedulerOutput, started: BitmaskInProgress | None
    ) -> tuple[GrammarOutput | None, Outputs]:
        """Waits for the fill ``_start_fill`` began: the step's bitmask and the requests that
        failed in the fill."""
        t0 = time.perf_counter()
        grammar, failed = self.scheduler.finish_grammar_bitmask(started)
        self.stats.add("bitmask", t0, time.perf_counter(), so.step_id)
        return grammar, failed

    def _sample(self, so: SchedulerOutput, grammar: GrammarOutput | None) -> SampledStep:
        """Queues the step's sampling with ``grammar``."""
        t0 = time.perf_counter()
        output = self.executor.sample_tokens(so.step_id, grammar)
        self.stats.add("launch", t0, time.perf_counter(), so.step_id)
        return SampledStep(so, output)

    def _wait(self, step: SampledStep) -> ModelRunnerOutput:
        """The step's tokens: the engine thread's one wait for the device, after the garbage
        collections that are due (the device works meanwhile)."""
        t0 = time.perf_counter()
        if self._gc.collect_if_due():
            t1 = time.perf_counter()
            self.stats.add("gc", t0, t1, step.so.step_id)
            t0 = t1
        out = step.output.get_output()
        now = time.perf_counter()
        self.stats.add("wait", t0, now, step.so.step_id)
        policy = self.scheduler.draft_policy
        # Only a decode step's time: a prompt chunk's cost is another matter.
        if (
            policy is not None
            and self._last_arrival is not None
            and (rows := decode_rows(step.so)) is not None
        ):
            drafted = bool(step.so.scheduled_spec_decode_tokens)
            policy.observe_step(rows, now - self._last_arrival, drafted)
        self._last_arrival = now
        return out

    def _update(self, step: SampledStep) -> Outputs:
        """Waits for the step's tokens and applies them."""
        out = self._wait(step)
        t1 = time.perf_counter()
        outputs = self.scheduler.update_from_output(step.so, out)
        self.stats.add("update", t1, time.perf_counter(), step.so.step_id)
        return outputs

    def _update_filling(
        self, step: SampledStep, deferred: SchedulerOutput, filler: FillThread
    ) -> tuple[Outputs, BitmaskInProgress | None]:
        """``_update`` that starts the deferred step's bitmask fill as soon as the grammars
        have taken the step's tokens: what the step's requests got, and the fill begun."""
        out = self._wait(step)
        t1 = time.perf_counter()
        verdicts = self.scheduler.advance_grammars(step.so, out)
        self.stats.add("update", t1, time.perf_counter(), step.so.step_id)
        started = self._start_fill(deferred, filler)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(step.so, out, verdicts)
        self.stats.add("update", t2, time.perf_counter(), step.so.step_id)
        return outputs, started

    def _idle(self) -> Outputs:
        # Only grammars still compiling: give the compile threads the CPU.
        self._last_arrival = None
        time.sleep(_IDLE_WAIT_S)
        return []

    def _fail_all(self, message: str) -> Outputs:
        logger.error("executor failed; failing every request: %s", message)
        self._dead = message
        sched = self.scheduler
        ids = [r.request_id for r in [*sched.running, *sched.waiting]]
        sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finish_reason="error", error=message) for rid in ids]

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self._filler is not None:
            self._filler.shutdown()


def _has_work(so: SchedulerOutput) -> bool:
    # A step with no tokens still tells the executor which requests finished.
    return not so.is_empty or bool(so.finished_request_ids)
