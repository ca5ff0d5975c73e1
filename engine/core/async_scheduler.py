"""The scheduler under async scheduling: tokens in flight count as placeholders."""

from __future__ import annotations

import dataclasses

from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler
from baton.engine.scheduler_output import SchedulerOutput


class AsyncScheduler(Scheduler):
    """Plans step N+1 before step N's tokens reach the CPU.

    After each schedule, every request that samples in the planned step gets
    one output placeholder, so the next schedule already counts that token as
    known (its value is read from device memory by the runner). The base
    class removes placeholders when real tokens arrive, zeroes them on
    preemption and drops stale deliveries for preempted requests.

    When a structured request that samples in the planned step still has a
    token in flight, its grammar cannot produce the step's bitmask yet: the
    output says so with ``pending_structured_output_tokens`` and the engine
    defers that step's sampling until the earlier tokens are applied.

    Speculative decoding: a request's drafts (proposed after its token in flight, see
    ``Scheduler._propose_drafts``) reserve one placeholder each, plus one for the token after
    them. How many the step keeps is known only when its tokens arrive, so the request sits
    out the step planned meanwhile and is scheduled again from its real length. That costs
    it a step per drafted step, so drafts shorter than ``min_drafts`` are not proposed.
    """

    # 1 + k tokens over two steps against 2 without drafts: two accepted drafts gain.
    min_drafts = 2

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        pending = False
        spec = so.scheduled_spec_decode_tokens
        for rid in so.num_scheduled_tokens:
            req = self.requests[rid]
            if req.num_computed_tokens < req.num_tokens_with_placeholders:
                continue  # a prefill chunk short of the prompt's end samples nothing
            if req.num_output_placeholders and rid in so.structured_request_ids:
                pending = True
            drafts = len(spec.get(rid, ()))
            req.num_output_placeholders += 1 + drafts
            req.num_draft_placeholders = drafts
        if pending:
            return dataclasses.replace(so, pending_structured_output_tokens=True)
        return so

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        if req.num_draft_placeholders:
            return 0  # its length is known when the step verifying its drafts returns
        return super()._num_new_tokens(req, budget)
