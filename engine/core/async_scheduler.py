"""The scheduler under async scheduling: tokens in flight count as placeholders."""

from __future__ import annotations

import dataclasses

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
    them, so the step planned meanwhile takes the request's next token as if every draft were
    kept (the runner reads it from its rows, where the verification left it). When the
    verification rejected some, that step's token for the request is dropped on arrival and
    the request goes on from its real length (``Scheduler._apply_tokens``): one wasted row.
    When every running request has drafts in flight and none waits, the step is left empty
    instead: a wasted row would then cost a whole forward, and waiting costs only the host's
    time between the verification and the next step, which then drafts from known tokens.
    """

    def schedule(self) -> SchedulerOutput:
        # Without drafts a request has at most one token in flight when a step is planned.
        if not self.waiting and all(r.num_output_placeholders > 1 for r in self.running):
            return self._make_output({}, [], {}, [])  # every running request is drafting
        so = super().schedule()
        pending = False
        spec = so.scheduled_spec_decode_tokens
        structured = so.structured_request_ids
        requests = self.requests
        for rid in so.num_scheduled_tokens:
            req = requests[rid]
            in_flight = req.num_output_placeholders
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            if req.num_computed_tokens < known + in_flight:
                continue  # a prefill chunk short of the prompt's end samples nothing
            if in_flight and rid in structured:
                pending = True
            req.num_output_placeholders = in_flight + 1 + (len(spec[rid]) if rid in spec else 0)
        if pending:
            return dataclasses.replace(so, pending_structured_output_tokens=True)
        return so
