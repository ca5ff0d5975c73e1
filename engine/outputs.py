"""What the front ends return: vLLM-compatible RequestOutput and friends."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """Logprob of one token at one position, with its rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Timing of one completion (seconds, monotonic clock)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first; None with < 2 tokens."""
        if self.num_generation_tokens < 2 or self.first_token_time is None:
            return None
        assert self.last_token_time is not None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # "invalid_spec": the structured-output spec could not be compiled because of the spec
    # itself (the caller's error); None for any other failure (the engine's).
    error_kind: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one prompt's completions after a step (or at the end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt
    # token a dict holding it and the top-k at its position (vLLM's shape); else None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The structured-output backend that served the request, and why the
    # preferred one did not (auto mode), if it did not.
    structured_output_backend: str | None = None
    structured_output_fallback_reason: str | None = None
    # A lenient structured request (allow_unenforced, json_schema.strict false): what its
    # backend did not enforce; None where everything was.
    structured_output_unenforced: str | None = None
