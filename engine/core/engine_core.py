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
standing between a sampling and the next forward. With the fill thread (never beside a
drafter) the grammars take step N's tokens first and the step's fill (``BitmaskFill``)
begins then: its native part runs on the thread, where that pays, beside the rest of the
update and the planning.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from baton.engine.core.bitmask_fill import BitmaskFill
from baton.engine.core.draft_policy import decode_rows
from baton.engine.core.fill_thread import FillThread
from baton.engine.core.request import Request, RequestStatus
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.stats import EngineStats
from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.gc_heap import StepCollector
from baton.engine.scheduler_output import (
    EngineCoreOutput,
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
        with self.stats.phase("launch", so.step_id):
            self.executor.execute_model(so)
        step, failed = self._sample(so)
        return [*outputs, *failed, *self._update(step)]

    def _overlap_step(self, last: InFlight | None) -> tuple[Outputs, InFlight | None]:
        outputs = self.scheduler.poll_grammars()
        sampled, deferred = (None, None) if last is None else (last.sampled, last.unsampled)
        fill = None
        if deferred is not None:  # its forward runs; its grammars wait for step N's tokens
            assert sampled is not None, "InFlight defers a step only behind a sampled one"
            applied, fill = self._update_and_fill(sampled, deferred)
            outputs += applied
        so = self._schedule() if self.scheduler.has_unfinished_requests() else None
        if deferred is not None and fill is not None:  # its sampling, then the next forward
            sampled, failed = self._sample(deferred, fill)
            outputs += failed
        ongoing = None
        if so is not None and _has_work(so):
            ongoing, failed = self._launch(so, sampled)
            outputs += failed
        elif fill is not None:
            # Step N's tokens are applied: return them now and leave the deferred step in
            # flight. Waiting for it here held back the last token of a request that stopped
            # in step N (the row after a stop is wasted) by one whole forward.
            ongoing = InFlight(sampled)
        elif sampled is None and so is not None:
            outputs += self._idle()
        if sampled is not None and (ongoing is None or ongoing.sampled is not sampled):
            outputs += self._update(sampled)  # the tokens of the step before, unless in flight
        return outputs, ongoing

    # ---------------------------------------------------------------- phases
    def _schedule(self) -> SchedulerOutput:
        with self.stats.phase("schedule") as span:
            so = self.scheduler.schedule()
            span.step_id = so.step_id
        if not so.is_empty:
            self.stats.steps += 1
        return so

    def _launch(self, so: SchedulerOutput, sampled: SampledStep | None) -> tuple[InFlight, Outputs]:
        """Queues the step's forward behind ``sampled`` (the step in flight, if any), and its
        sampling too unless a grammar in it waits for ``sampled``'s tokens (it is deferred
        then): the steps now in flight, and the requests that failed in the fill."""
        with self.stats.phase("launch", so.step_id):
            self.executor.execute_model(so)
        if so.pending_structured_output_tokens and sampled is not None:
            # A grammar in it waits for step N's token (with no step in flight there is
            # nothing to wait for: a placeholder count gone stale must not stall it).
            self.stats.deferred_steps += 1
            return InFlight(sampled, so), []
        step, failed = self._sample(so)  # the bitmask overlaps the forwards
        return InFlight(step), failed

    def _sample(
        self, so: SchedulerOutput, fill: BitmaskFill | None = None
    ) -> tuple[SampledStep, Outputs]:
        """Queues the step's sampling with its bitmask (``fill``, begun earlier, or filled
        now): the step in flight, and the requests that failed in the fill."""
        with self.stats.phase("bitmask", so.step_id):
            if fill is None:
                fill = self.scheduler.begin_fill(so, self.executor.bitmask_buffer())
            grammar, failed = fill.wait()
        with self.stats.phase("launch", so.step_id):
            output = self.executor.sample_tokens(so.step_id, grammar)
        return SampledStep(so, output), failed

    def _wait(self, step: SampledStep) -> ModelRunnerOutput:
        """The step's tokens: the engine thread's one wait for the device, after the garbage
        collections that are due (the device works meanwhile)."""
        with self.stats.phase("gc", step.so.step_id) as collected:
            collected.keep = self._gc.collect_if_due()
        with self.stats.phase("wait", step.so.step_id) as waited:
            out = step.output.get_output()
        now = waited.end
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
        with self.stats.phase("update", step.so.step_id):
            return self.scheduler.update_from_output(step.so, out)

    def _update_and_fill(
        self, step: SampledStep, deferred: SchedulerOutput
    ) -> tuple[Outputs, BitmaskFill]:
        """``_update`` that begins the deferred step's bitmask fill once its grammars have the
        step's tokens: what the step's requests got, and the fill. With the fill thread (no
        drafter) the grammars take the tokens first, and the fill's native part may run on
        the thread beside the rest of the update and the next schedule; otherwise the fill
        begins (and is done) after the whole update."""
        out = self._wait(step)
        sid, thread = step.so.step_id, self._filler
        with self.stats.phase("update", sid):
            if thread is None:
                outputs = self.scheduler.update_from_output(step.so, out)
            else:
                verdicts = self.scheduler.advance_grammars(step.so, out)
        with self.stats.phase("bitmask", deferred.step_id):
            fill = self.scheduler.begin_fill(deferred, self.executor.bitmask_buffer(), thread)
        if thread is not None:
            with self.stats.phase("update", sid):
                outputs = self.scheduler.update_from_output(step.so, out, verdicts)
        return outputs, fill

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
