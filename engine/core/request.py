"""A request's life inside the engine core: its tokens, status and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import Logprobs, PromptLogprobs
from baton.grammar.backend import GrammarMatcher
from baton.grammar.compile.service import CompileHandle
from baton.grammar.reasoning import ReasoningSpec
from baton.grammar.spec import StructuredOutputsParams


@dataclass
class StructuredState:
    """One request's grammar: pending compile, then its matcher."""

    spec: StructuredOutputsParams
    handle: CompileHandle | None = None
    matcher: GrammarMatcher | None = None
    backend: str | None = None
    fallback_reason: str | None = None
    compile_seconds: float = 0.0
    # The reasoning before the grammar holds (engine's reasoning parser), or None.
    reasoning: ReasoningSpec | None = None
    # A lenient spec (allow_unenforced): what its backend does not enforce, or None.
    unenforced: str | None = None


@dataclass
class PromptLogprobsSoFar:
    """A request's prompt logprobs as its prompt chunks deliver them, until they go out
    with its first token. A chunk computed again (after a preemption) is delivered again:
    only the positions not held yet are kept."""

    rows: Logprobs = field(default_factory=lambda: Logprobs([], [], []))
    sent: bool = False

    def add(self, part: PromptLogprobs) -> None:
        """Keeps ``part``'s positions past those held.

        Raises:
            RuntimeError: ``part`` starts past the next position (a chunk went missing).
        """
        held = self.rows
        skip = len(held.ranks) + 1 - part.start  # the first prompt token has no row
        if skip < 0:
            raise RuntimeError(
                f"prompt logprobs from position {part.start}, but only {len(held.ranks)} held"
            )
        held.token_ids.extend(part.rows.token_ids[skip:])
        held.logprobs.extend(part.rows.logprobs[skip:])
        held.ranks.extend(part.rows.ranks[skip:])

    def take(self) -> Logprobs | None:
        """All the rows, the first time (None after)."""
        if self.sent:
            return None
        self.sent = True
        return self.rows


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason: stop, length, abort, error; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # a live entity: compared by identity, not field by field
class Request:
    """Mutable scheduler-side state of one sequence.

    ``num_computed_tokens`` counts tokens whose keys/values are (or, once the
    queued step runs, will be) in the KV cache. ``num_output_placeholders``
    counts sampled tokens still in flight (async scheduling); the scheduler
    treats them as known; a step verifying drafts reserves one per draft and one more.
    Deliveries of steps up to ``stale_through_step`` are dropped: they were planned past
    drafts that turned out rejected.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed: int
    arrival_time: float
    output_token_ids: list[int]
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    stale_through_step: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    structured: StructuredState | None = None
    # With sampling_params.prompt_logprobs: the rows delivered so far.
    prompt_logprobs: PromptLogprobsSoFar | None = None

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        seed: int,
    ) -> Request:
        return cls(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_ids=eos_token_ids,
            seed=seed,
            arrival_time=time.monotonic(),
            output_token_ids=[],
            prompt_logprobs=(
                None if sampling_params.prompt_logprobs is None else PromptLogprobsSoFar()
            ),
        )

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit would skip prompt positions whose logprobs are owed."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.sent

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs that have reached the CPU."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished


def surely_finishes(req: Request, max_model_len: int) -> bool:
    """Whether ``req``'s tokens in flight reach its max_tokens or ``max_model_len``: it ends
    with them anyway, so it needs no further step."""
    max_tokens = req.sampling_params.max_tokens or max_model_len
    produced = len(req.output_token_ids) + req.num_output_placeholders
    return produced >= max_tokens or len(req.prompt_token_ids) + produced >= max_model_len


def check_stop(req: Request, token: int, max_model_len: int) -> bool:
    """Whether ``req`` stops at its newest output ``token``: the grammar ended it, an EOS or a
    stop token after ``min_tokens``, or its length. Side effects: sets its finished status
    (and ``stop_reason`` for a stop token)."""
    if req.status is RequestStatus.FINISHED_STOPPED:  # the grammar ended
        return True
    sp = req.sampling_params
    n_out = len(req.output_token_ids)
    if n_out >= sp.min_tokens:
        if not sp.ignore_eos and token in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in sp.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token
            return True
    if (sp.max_tokens is not None and n_out >= sp.max_tokens) or (
        len(req.prompt_token_ids) + n_out >= max_model_len
    ):
        req.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
