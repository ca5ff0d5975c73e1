"""Continuous-batching scheduler: token budget, chunked prefill, preemption, stops."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from baton.engine.config import EngineConfig
from baton.engine.core.bitmask_fill import BitmaskFill
from baton.engine.core.draft_policy import DraftPolicy
from baton.engine.core.drafter import Drafter, propose_within
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus, check_stop, surely_finishes
from baton.engine.kv_capacity import refusal_message
from baton.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from baton.engine.core.fill_thread import FillThread
    from baton.engine.core.structured_outputs import GrammarVerdict, StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides which tokens each step computes and applies each step's results.

    Running requests go first (decode or the rest of a chunked prefill), in
    arrival order; then waiting ones are admitted while the token budget,
    ``max_num_seqs`` and the KV cache allow. When blocks run out, the most
    recently admitted running request is preempted (its blocks freed, to be
    recomputed later, mostly from the prefix cache).
    """

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        structured: StructuredOutputManager | None = None,
        drafter: Drafter | None = None,
        draft_policy: DraftPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.structured = structured
        self.drafter = drafter
        # How many drafts pay for their rows (None: always up to num_speculative_tokens).
        self.draft_policy = draft_policy if drafter is not None else None
        # Blocks held by requests whose rejected drafts freed some, for the next step.
        self._kept_blocks: dict[str, int] = {}
        # Requests whose runner rows hold tokens planned past rejected drafts (async): their
        # real token counts and how many tokens past them were planned, for the next step.
        self._rewound: dict[str, tuple[int, int]] = {}
        self.num_wasted_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafted_steps = 0
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        # Error outputs of requests refused while scheduling, for the next update.
        self._refused: list[EngineCoreOutput] = []
        self._step_id = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            if self.structured is None:
                raise ValueError("this engine has no structured-output support")
            request.structured = self.structured.start(
                spec, request.prompt_token_ids, request.sampling_params.max_reasoning_tokens
            )
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finishes (aborts, errors) requests wherever they are; unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plans the next step. Side effects: allocates KV blocks, admits and
        preempts requests, and advances ``num_computed_tokens``."""
        budget = self.config.max_num_batched_tokens
        num_sched: dict[str, int] = {}
        new_reqs: list[Request] = []
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        drafts: dict[str, tuple[int, ...]] = {}

        drafter, policy, depth = self.drafter, self.draft_policy, self._draft_depth()
        offered: list[int] = []  # drafts each drafting request proposed, for the policy
        release, window = self.kv.release_outside_window, self.kv.releases_blocks
        running = RequestStatus.RUNNING
        for req in list(self.running):
            if req.status is not running:  # preempted earlier in this loop
                continue
            n = self._num_new_tokens(req, budget)
            if n <= 0:
                continue
            proposed = (
                propose_within(drafter, req, n, budget, depth, self.max_model_len) if depth else ()
            )
            if depth and policy is not None and drafter.can_draft(req):
                offered.append(len(proposed))
            n += len(proposed)
            if window:  # the lowest position it may compute again: its last known token's
                release(req.request_id, min(req.num_computed_tokens, req.num_tokens - 1))
            blocks = self._allocate_or_preempt(req, req.num_computed_tokens + n, preempted)
            if req.status is not running:
                continue
            num_sched[req.request_id] = n
            new_blocks[req.request_id] = blocks
            if proposed:
                drafts[req.request_id] = proposed
            budget -= n

        if offered and policy is not None:
            policy.observe_proposals(depth, offered)

        skipped: list[Request] = []  # grammars still compiling: they keep their place
        while self.waiting and not preempted and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(self.waiting.popleft())
                continue
            # Owed prompt logprobs need every prompt position computed (as vLLM).
            skip = req.skips_prefix_cache
            cached = 0 if skip else self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            n = self._num_new_tokens(req, budget)
            blocks = self.kv.allocate_slots(req.request_id, cached + n, cached)
            if blocks is None:
                req.num_computed_tokens = 0
                if self.running:
                    break
                alone = self._allocate_alone(req, cached, budget)
                if alone is None:
                    continue  # refused: finished with an error
                n = alone
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_reqs.append(req)
            num_sched[req.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        out = self._make_output(num_sched, new_reqs, new_blocks, preempted, drafts)
        requests = self.requests
        for rid, n in num_sched.items():
            requests[rid].num_computed_tokens += n
        return out

    def poll_grammars(self) -> list[EngineCoreOutput]:
        """Looks at the compiling grammars of the waiting requests the next ``schedule`` could
        admit (front of the queue, up to the free running slots): a ready one lets its request
        be admitted, a failed one finishes its request with an error. Returns those error
        outputs. Requests further back are not looked at yet: a compile's time limit counts
        from its submission, and their turn is not near."""
        if self.structured is None:
            return []
        room = self.config.max_num_seqs - len(self.running)
        broken: list[tuple[Request, str, str | None]] = []
        for req in self.waiting:
            if room <= 0:
                break
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                assert req.structured is not None
                result = self.structured.poll(req.structured)
                if result is None:
                    continue
                if req.structured.matcher is None:
                    # A spec its backends refuse is the caller's error (the server answers 400).
                    kind = "invalid_spec" if result.spec_error else None
                    broken.append((req, f"grammar compilation failed: {result.error}", kind))
                    continue
                req.status = RequestStatus.WAITING
            room -= 1
        return [self._fail(req, message, kind) for req, message, kind in broken]

    def begin_fill(
        self, so: SchedulerOutput, out: torch.Tensor | None = None, thread: FillThread | None = None
    ) -> BitmaskFill:
        """Begins filling the bitmask rows of this step's structured requests that will sample
        (into ``out`` when given); ``BitmaskFill.wait`` returns them with the error outputs of
        requests whose grammar failed to fill its row (they are finished then; the token
        sampled for them is dropped). With ``thread`` the fill's native part may run there
        while the caller schedules the next step (see ``fills_beside_schedule``).

        Under async scheduling a deferred step's fill begins after the previous step's
        tokens reached its grammars: requests that finished or were preempted since get no
        row (their token will be dropped).
        """
        if self.structured is None or not so.structured_request_ids:
            return BitmaskFill(None, self._fail)
        requests = [
            req
            for rid in so.structured_request_ids
            if (req := self.requests.get(rid)) is not None and req.status == RequestStatus.RUNNING
        ]
        drafts = so.scheduled_spec_decode_tokens
        return BitmaskFill.begin(self.structured, requests, self._fail, out, drafts, thread)

    def fills_beside_schedule(self) -> bool:
        """True when ``schedule`` never touches a grammar matcher, so a step's bitmask may be
        filled on another thread while the next step is scheduled (drafters read matchers)."""
        return self.drafter is None

    def _draft_depth(self) -> int:
        """The most drafts per request this step: the policy's choice for the running
        requests, ``num_speculative_tokens`` without a policy, 0 without a drafter."""
        drafter = self.drafter
        if drafter is None:
            return 0
        if self.draft_policy is None:
            return drafter.config.num_speculative_tokens
        drafting = sum(1 for req in self.running if drafter.can_draft(req))
        return self.draft_policy.depth(len(self.running), drafting)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        # Once per request a step: the properties' arithmetic inlined.
        in_flight = req.num_output_placeholders
        n = len(req.prompt_token_ids) + len(req.output_token_ids) + in_flight
        n -= req.num_computed_tokens
        if in_flight and surely_finishes(req, self.max_model_len):
            return 0
        return max(0, min(n, budget, self.max_model_len - req.num_computed_tokens))

    def _allocate_or_preempt(
        self, req: Request, num_tokens: int, preempted: list[Request]
    ) -> list[int] | None:
        """Blocks for a running request's ``num_tokens``, preempting the latest admitted ones
        (added to ``preempted``) until they fit: None if ``req`` itself was preempted, or
        refused because it does not fit even alone (``_refuse``)."""
        while (blocks := self.kv.allocate_slots(req.request_id, num_tokens)) is None:
            if len(self.running) == 1:  # alone, every other block free: it never fits
                self._refuse(req, num_tokens)
                return None
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None
        return blocks

    def _allocate_alone(self, req: Request, cached: int, budget: int) -> int | None:
        """Admits a request that found no room while nothing runs without its prefix hits (a
        windowed group takes them all until the next release): its tokens, or None (refused)."""
        if cached:
            req.num_computed_tokens = 0
            req.num_cached_tokens = 0 if req.num_cached_tokens == cached else req.num_cached_tokens
            n = self._num_new_tokens(req, budget)
            if self.kv.allocate_slots(req.request_id, n) is not None:
                return n
        self._refuse(req, self._num_new_tokens(req, budget))
        return None

    def _refuse(self, req: Request, num_tokens: int) -> None:
        """Fails a request whose ``num_tokens`` find no blocks while it is alone, its output sent
        with the next update (``kv_capacity.py``: max_model_len is lowered so that it fits)."""
        kv, limit = self.kv, self.max_model_len
        message = refusal_message(req.request_id, num_tokens, kv.num_blocks, kv.block_size, limit)
        logger.error("%s", message)
        self._refused.append(self._fail(req, message))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s", req.request_id)

    def _make_output(
        self,
        num_sched: dict[str, int],
        new_reqs: list[Request],
        new_blocks: dict[str, list[int]],
        preempted: list[Request],
        drafts: dict[str, tuple[int, ...]] | None = None,
    ) -> SchedulerOutput:
        self._step_id += 1
        new_data = tuple(
            NewRequestData(
                request_id=r.request_id,
                prompt_token_ids=tuple(r.prompt_token_ids),
                output_token_ids=tuple(r.output_token_ids),
                sampling_params=r.sampling_params,
                seed=r.seed,
                block_ids=tuple(self.kv.get_block_ids(r.request_id)),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in new_reqs
        )
        requests = self.requests
        cached = tuple(
            [
                CachedRequestData(rid, tuple(blocks), requests[rid].num_computed_tokens)
                for rid, blocks in new_blocks.items()
            ]
        )
        finished = frozenset(self._finished_ids) | {r.request_id for r in preempted}
        self._finished_ids.clear()
        kept = {rid: n for rid, n in self._kept_blocks.items() if rid not in finished}
        self._kept_blocks.clear()
        rewound = {rid: n for rid, n in self._rewound.items() if rid not in finished}
        self._rewound.clear()
        if drafts:
            self.num_drafted_steps += 1
            self.num_draft_tokens += sum(len(d) for d in drafts.values())
        return SchedulerOutput(
            step_id=self._step_id,
            new_requests=new_data,
            cached_requests=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_request_ids=finished,
            preempted_request_ids=frozenset(r.request_id for r in preempted),
            # Request.num_tokens_with_placeholders inlined: once per request a step.
            structured_request_ids=frozenset(
                [
                    rid
                    for rid, n in num_sched.items()
                    if (req := requests[rid]).structured is not None
                    and req.num_computed_tokens + n
                    >= len(req.prompt_token_ids)
                    + len(req.output_token_ids)
                    + req.num_output_placeholders
                ]
            ),
            scheduled_spec_decode_tokens=drafts or {},
            num_kept_blocks=kept,
            rewound=rewound,
            kv_block_copies=self.kv.take_block_copies(),
        )

    # ------------------------------------------------------------------ update
    def update_from_output(
        self,
        so: SchedulerOutput,
        out: ModelRunnerOutput,
        verdicts: Mapping[str, GrammarVerdict] | None = None,
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop conditions, frees finished requests.

        ``verdicts`` are ``advance_grammars``' results for this output (called here when not
        given): those requests' grammars already took their token. Returns one output per
        request that got tokens or finished this step. A failure while handling one request
        finishes only that request, with an error.
        """
        if verdicts is None:
            verdicts = self.advance_grammars(so, out)
        results: list[EngineCoreOutput] = []
        if self._refused:
            results, self._refused = self._refused, []
        requests, spec = self.requests, so.scheduled_spec_decode_tokens
        preempted, step_id, running = so.preempted_request_ids, so.step_id, RequestStatus.RUNNING
        for rid, tokens in zip(out.request_ids, out.sampled_token_ids, strict=True):
            req = requests.get(rid)
            # A stale delivery: the request is not running (finished, or preempted after this
            # step was planned), or the step was planned past drafts that were rejected (async).
            if (
                req is None
                or req.status is not running
                or rid in preempted
                or step_id <= req.stale_through_step
            ):
                continue
            try:
                num_drafts = len(spec[rid]) if spec and rid in spec else 0
                verdict = verdicts.get(rid)
                applied = self._apply_tokens(req, tokens, out, num_drafts, verdict)
                if applied is not None:
                    results.append(applied)
            except Exception as exc:  # noqa: BLE001 - one request's bug must not stop the rest
                logger.exception("request %s failed while applying its output", rid)
                results.append(self._fail(req, f"{type(exc).__name__}: {exc}"))
        return results

    def advance_grammars(
        self, so: SchedulerOutput, out: ModelRunnerOutput
    ) -> dict[str, GrammarVerdict]:
        """Advances the grammars of the structured requests by their token of ``out`` ahead
        of ``update_from_output`` (pass it the result), so the next step's bitmask can be
        filled while the rest of the update runs. Only requests with one token that
        ``update_from_output`` would apply are advanced (a drafted step's are left to it);
        nothing else about a request changes here."""
        if self.structured is None:
            return {}
        reqs: list[Request] = []
        toks: list[int] = []
        requests, spec, errors = self.requests, so.scheduled_spec_decode_tokens, out.errors
        preempted, step_id, running = so.preempted_request_ids, so.step_id, RequestStatus.RUNNING
        for rid, tokens in zip(out.request_ids, out.sampled_token_ids, strict=True):
            req = requests.get(rid)
            if (  # the deliveries update_from_output applies (see there), with one token
                len(tokens) == 1
                and req is not None
                and req.structured is not None
                and rid not in spec
                and rid not in errors
                and req.status is running
                and rid not in preempted
                and step_id > req.stale_through_step
            ):
                reqs.append(req)
                toks.append(tokens[0])
        results = self.structured.advance(reqs, toks)
        return dict(zip([req.request_id for req in reqs], results, strict=True))

    def _apply_tokens(
        self,
        req: Request,
        tokens: list[int],
        out: ModelRunnerOutput,
        num_drafts: int = 0,
        verdict: GrammarVerdict | None = None,
    ) -> EngineCoreOutput | None:
        error = out.errors.get(req.request_id)
        if error is not None:
            return self._fail(req, error)
        if out.prompt_logprobs and req.prompt_logprobs is not None:
            part = out.prompt_logprobs.get(req.request_id)
            if part is not None:
                req.prompt_logprobs.add(part)
        if not tokens:
            self._cache_known(req)
            return None
        # A step with drafts reserved a placeholder per draft and one more, whatever it kept.
        consumed = 1 + num_drafts if num_drafts else len(tokens)
        req.num_output_placeholders = max(0, req.num_output_placeholders - consumed)
        if num_drafts:
            self._reject_drafts(req, num_drafts, len(tokens) - 1)
        accepted: list[int] = []
        for tok in tokens:
            if req.structured is not None:
                # The first token's verdict came from advance_grammars, except a drafted step's.
                took, verdict = verdict, None
                if took is None:
                    assert self.structured is not None
                    took = self.structured.advance([req], [tok])[0]
                if took.error is not None:
                    return self._fail(req, took.error)
                if took.terminated:
                    req.status = RequestStatus.FINISHED_STOPPED
            req.output_token_ids.append(tok)
            accepted.append(tok)
            if check_stop(req, tok, self.max_model_len):
                break
        self._cache_known(req)
        status = req.status
        finish = None if status is RequestStatus.RUNNING else status.finish_reason
        if finish is not None:
            self._remove_finished(req)
        structured = req.structured
        logprobs = out.logprobs.get(req.request_id) if out.logprobs else None
        # Positional: built once per request a step (keywords cost a third more).
        return EngineCoreOutput(
            req.request_id,
            accepted,
            finish,
            req.stop_reason,
            None if logprobs is None else _first(logprobs, len(accepted)),
            req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
            None,
            None,
            structured.backend if structured else None,
            structured.fallback_reason if structured else None,
            structured.unenforced if structured else None,
            None if req.prompt_logprobs is None else req.prompt_logprobs.take(),
        )

    def _reject_drafts(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Forgets the KV slots of the rejected drafts: they count as not computed, and
        blocks past the accepted tokens go back to the pool. Call it after the step's own
        placeholders are released: any left belong to steps planned since (async)."""
        self.num_accepted_tokens += num_accepted
        if self.draft_policy is not None:
            self.draft_policy.observe_drafts(num_drafts, num_accepted)
        rejected = num_drafts - num_accepted
        if rejected <= 0:
            return
        req.num_computed_tokens -= rejected
        if req.num_output_placeholders:
            # Async: the steps planned since fed the token after the drafts as if all were
            # kept. Their tokens are dropped on arrival, and the runner forgets what they
            # recorded, so the request goes on from its real length.
            past = req.num_output_placeholders
            req.num_computed_tokens -= past
            req.num_output_placeholders = 0
            req.stale_through_step = self._step_id
            self._rewound[req.request_id] = (req.num_tokens + num_accepted + 1, past)
            self.num_wasted_rows += 1
        held = len(self.kv.get_block_ids(req.request_id))
        kept = self.kv.truncate(req.request_id, req.num_computed_tokens)
        if kept < held:
            self._kept_blocks[req.request_id] = kept

    def _cache_known(self, req: Request) -> None:
        """Registers the request's blocks now full of known tokens for prefix reuse."""
        known = min(
            req.num_computed_tokens - req.num_output_placeholders,
            len(req.prompt_token_ids) + len(req.output_token_ids),
        )
        if self.kv.fills_new_block(req.request_id, known):  # the token list costs µs
            self.kv.cache_blocks(req.request_id, req.all_token_ids, known)

    def _fail(self, req: Request, message: str, kind: str | None = None) -> EngineCoreOutput:
        req.status = RequestStatus.FINISHED_ERROR
        req.error = message
        self._remove_finished(req)
        return EngineCoreOutput(
            req.request_id, [], finish_reason="error", error=message, error_kind=kind
        )

    def _remove_finished(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self._finished_ids.add(req.request_id)
        self.requests.pop(req.request_id, None)


def _first(logprobs: Logprobs | None, n: int) -> Logprobs | None:
    """The logprobs of the first ``n`` tokens (a stop among accepted drafts drops the rest)."""
    if logprobs is None or len(logprobs.ranks) <= n:
        return logprobs
    return Logprobs(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
