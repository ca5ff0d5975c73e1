"""The engine core: schedule, forward, bitmask, sample, update; synchronous or one step ahead."""

from __future__ import annotations

import logging
import time
from collections import deque

from baton.engine.core.request import Request, RequestStatus
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.stats import EngineStats
from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
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


class EngineCore:
    """Drives the scheduler and an executor.

    ``step()`` runs one step to completion. ``step_with_batch_queue()`` (async
    scheduling) plans and queues step N+1 before waiting for step N, computes
    N+1's bitmask while the device runs, and defers N+1's sampling only when a
    structured request in it still has a token in flight.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        async_scheduling: bool = False,
        max_concurrent_batches: int = 2,
        checker: SyncChecker | None = None,
    ) -> None:
        if async_scheduling and not executor.supports_async_scheduling():
            raise ValueError(f"{type(executor).__name__} does not support async scheduling")
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.max_concurrent_batches = max_concurrent_batches if async_scheduling else 1
        self.checker = checker or SyncChecker("off")
        self.stats = EngineStats()
        self.batch_queue: deque[tuple[SchedulerOutput, AsyncOutput]] = deque()
        self.deferred: SchedulerOutput | None = None
        self._dead: str | None = None
        self._last_step_end: float | None = None

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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue or self.deferred)

    def run_step(self) -> list[EngineCoreOutput]:
        """One step in the configured mode; an executor failure fails every request."""
        t0 = time.perf_counter()
        if self._last_step_end is not None and t0 - self._last_step_end < _MAX_FRONT_END_GAP_S:
            # Front-end work between steps (detokenising) overlaps the device too.
            self.stats.engine_s += t0 - self._last_step_end
        wait0, device0 = self.stats.device_wait_s, self.executor.device_seconds
        deferred0 = self.stats.deferred_steps
        try:
            with self.checker.guard():
                outputs = self.step_with_batch_queue() if self.async_scheduling else self.step()
        except ExecutorError as exc:
            return self._fail_all(str(exc))
        self.stats.record(
            time.perf_counter() - t0,
            self.stats.device_wait_s - wait0,
            self.executor.device_seconds - device0,
            self.stats.deferred_steps > deferred0,
        )
        self._last_step_end = time.perf_counter()
        return outputs

    # ------------------------------------------------------------------ modes
    def step(self) -> list[EngineCoreOutput]:
        """Runs one engine step synchronously; returns what each request got from it."""
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self._schedule()
        if so.is_empty and not so.finished_request_ids:
            return self._idle(so)
        self.executor.execute_model(so)
        future = self.executor.sample_tokens(so.step_id, self._bitmask(so))
        return self._update(so, self._wait(future))

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Queues step N+1, then waits only for step N; returns step N's outputs."""
        if self.deferred is None and len(self.batch_queue) < self.max_concurrent_batches:
            so = self._schedule() if self.scheduler.has_unfinished_requests() else None
            if so is not None and (not so.is_empty or so.finished_request_ids):
                self.executor.execute_model(so)
                if so.pending_structured_output_tokens:
                    self.deferred = so
                    self.stats.deferred_steps += 1
                else:
                    self._queue_sampling(so)
                    if len(self.batch_queue) < self.max_concurrent_batches:
                        return []  # room for one more step before waiting
            elif so is not None and not self.batch_queue:
                return self._idle(so)
        outputs: list[EngineCoreOutput] = []
        if self.batch_queue:
            so, future = self.batch_queue.popleft()
            outputs = self._update(so, self._wait(future))
        if self.deferred is not None:
            # The deferred step's grammars have now seen every earlier token.
            so, self.deferred = self.deferred, None
            self._queue_sampling(so)
        return outputs

    # ---------------------------------------------------------------- phases
    def _queue_sampling(self, so: SchedulerOutput) -> None:
        self.batch_queue.append((so, self.executor.sample_tokens(so.step_id, self._bitmask(so))))

    def _schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.stats.schedule_s += time.perf_counter() - t0
        if not so.is_empty:
            self.stats.steps += 1
        return so

    def _bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        t0 = time.perf_counter()
        grammar = self.scheduler.get_grammar_bitmask(so, self.executor.bitmask_buffer())
        self.stats.bitmask_s += time.perf_counter() - t0
        return grammar

    def _wait(self, future: AsyncOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        out = future.get_output()
        self.stats.device_wait_s += time.perf_counter() - t0
        return out

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, out)
        self.stats.update_s += time.perf_counter() - t0
        return outputs

    def _idle(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        # Only grammars still compiling: give the compile threads the CPU.
        time.sleep(_IDLE_WAIT_S)
        return self.scheduler.update_from_output(so, ModelRunnerOutput([], []))

    def _fail_all(self, message: str) -> list[EngineCoreOutput]:
        logger.error("executor failed; failing every request: %s", message)
        self._dead = message
        self.batch_queue.clear()
        self.deferred = None
        sched = self.scheduler
        ids = [r.request_id for r in [*sched.running, *sched.waiting]]
        sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finish_reason="error", error=message) for rid in ids]

    def shutdown(self) -> None:
        self.executor.shutdown()
