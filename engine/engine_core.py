"""The engine core: one step = schedule, forward, sample, update."""

from __future__ import annotations

import logging
import time

from baton.engine.model_runner import ModelRunner
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler import Scheduler
from baton.engine.scheduler_output import EngineCoreOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002


class EngineCore:
    """Drives the scheduler and the model runner, synchronously, one step at a time."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finishes requests as aborted and frees their KV blocks; unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Runs one engine step; returns what each request got from it."""
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self.scheduler.schedule()
        if so.is_empty and not so.finished_request_ids:
            # Only grammars still compiling: give the compile threads the CPU.
            time.sleep(_IDLE_WAIT_S)
            return self.scheduler.update_from_output(so, ModelRunnerOutput([], []))
        fwd = self.runner.execute_model(so)
        grammar = self.scheduler.get_grammar_bitmask(so)
        out = self.runner.sample_tokens(fwd, grammar)
        return self.scheduler.update_from_output(so, out)
