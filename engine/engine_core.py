"""The engine core: one step = schedule, forward, sample, update."""

from __future__ import annotations

import logging

from baton.engine.model_runner import ModelRunner
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler import Scheduler
from baton.engine.scheduler_output import EngineCoreOutput

logger = logging.getLogger(__name__)


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
        fwd = self.runner.execute_model(so)
        out = self.runner.sample_tokens(fwd, grammar=None)
        return self.scheduler.update_from_output(so, out)
