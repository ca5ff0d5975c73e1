"""Values handed between the scheduler, the model runner and the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from baton.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no row for (first schedule, or resumed after preemption)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Outputs produced before a preemption; the runner recomputes them as context.
    output_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    seed: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int


class CachedRequestData(NamedTuple):
    """A request the runner already holds: only what changed."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes.

    ``num_scheduled_tokens`` is ordered: it fixes the row order of the flat
    batch. ``num_computed_tokens`` in the request data is the value *before*
    this step.
    """

    step_id: int
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_request_ids: frozenset[str]
    preempted_request_ids: frozenset[str] = frozenset()
    # Structured requests that sample this step (they need a bitmask row).
    structured_request_ids: frozenset[str] = frozenset()
    # Async scheduling: a structured request scheduled here already has a
    # token in flight, so its grammar cannot be advanced before sampling.
    pending_structured_output_tokens: bool = False
    # Speculative decoding: the draft tokens each request feeds after its last token (its
    # ``num_scheduled_tokens`` is 1 + len(drafts)); the step samples at every draft position
    # plus one and keeps the longest verified prefix.
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Requests whose rejected drafts freed KV blocks since the last step: how many blocks
    # each still holds (the runner cuts its block table to that before appending new ones).
    num_kept_blocks: dict[str, int] = field(default_factory=dict)
    # Async scheduling: requests whose step after a drafted one was planned as if every draft
    # were kept, when the verification rejected some: each one's real token count, and how
    # many tokens were planned past it (the most the runner may have recorded there). The
    # runner forgets what it recorded past the real count before this step's changes.
    rewound: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Prefix caching past a block boundary: (source, destination) KV blocks the runner copies,
    # in order, before this step's forward (a new request's first tokens, from a cached block
    # that starts with them).
    kv_block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


def bitmask_rows(request_ids: tuple[str, ...], row_counts: tuple[int, ...]) -> int:
    """Bitmask rows of a ``GrammarOutput`` with these fields: one per request, or the counts'
    sum."""
    return sum(row_counts) if row_counts else len(request_ids)


@dataclass(frozen=True)
class GrammarOutput:
    """Grammar bitmask rows for the structured requests of one step.

    ``bitmask`` is int32 ``[rows, ceil(vocab / 32)]``: one row per request, or with
    ``row_counts`` (speculative decoding) ``row_counts[i]`` consecutive rows for request i,
    the mask at its last token and at each of its draft tokens.
    """

    request_ids: tuple[str, ...]
    bitmask: torch.Tensor
    row_counts: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """Bitmask rows in all."""
        return bitmask_rows(self.request_ids, self.row_counts)

    def rows_of(self) -> list[tuple[str, int, int]]:
        """(request id, first bitmask row, number of rows) per request."""
        counts = self.row_counts or (1,) * len(self.request_ids)
        out, start = [], 0
        for rid, n in zip(self.request_ids, counts, strict=True):
            out.append((rid, start, n))
            start += n
        return out


@dataclass(frozen=True)
class Logprobs:
    """Logprobs of sampled tokens: per token, the sampled id then the top-k, with ranks."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of a run of prompt tokens, from one step's prompt chunk: ``rows`` holds per
    token its id then the top-k (with the token's rank), for prompt positions ``start``,
    ``start + 1``, ... (``start`` >= 1: the first prompt token has no logprob)."""

    start: int
    rows: Logprobs


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Tokens sampled by one step, per request in scheduled order.

    A request that sampled nothing (a prefill chunk short of its prompt's end)
    has an empty list.
    """

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # Requests with prompt_logprobs whose prompt chunk ran this step (sampling or not).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class EngineCoreOutput(NamedTuple):
    """What one request got from one step (immutable, like the frozen hand-offs here).

    A named tuple rather than a frozen dataclass: the engine makes one per request and step,
    and a frozen dataclass took 1.3 us to build against 0.5 (measured, 10 fields): 0.2 ms a
    step at batch 256, where the host's step time is what keeps a fast device waiting.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # "invalid_spec" when the request failed because its structured-output spec cannot be
    # compiled (the caller's error, not the engine's); None for any other failure.
    error_kind: str | None = None
    # Which structured-output backend served the request, and why not the preferred one.
    structured_backend: str | None = None
    structured_fallback_reason: str | None = None
    # A lenient spec's keywords its backend did not enforce (None: all enforced).
    structured_unenforced: str | None = None
    # With prompt_logprobs, on the request's first output: every prompt token's but the
    # first, in order.
    prompt_logprobs: Logprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
