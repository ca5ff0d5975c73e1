"""User-facing sampling parameters (vLLM-compatible subset)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from baton.grammar.spec import StructuredOutputsParams

_MAX_SEED = 2**63 - 1
# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions; validated once at construction.

    Raises:
        ValueError: naming the field and its allowed range, for any invalid value.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # Per prompt token (after the first): its logprob and the top-k at its position, from
    # the raw logits (vLLM's field). Such a request skips prefix-cache hits: every prompt
    # position is computed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # With the engine's reasoning parser: thinking tokens allowed before a structured answer;
    # then the end-of-think token is forced and the grammar begins. None: unbounded.
    max_reasoning_tokens: int | None = None
    # Added to the token's logit before sampling (OpenAI's logit_bias): given as a mapping
    # token id -> bias in [-100, 100] (or such pairs), kept as pairs sorted by id. The grammar
    # mask still holds: a biased token it forbids stays forbidden.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Accept any sequence (list, a single string) for the two tuple fields.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "None or an int >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0")
        budget = self.max_reasoning_tokens
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise bad("max_reasoning_tokens", "None or an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not _is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "a number in [0, 100]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an int >= 0 (0 or -1 disables it)")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise bad("seed", f"None or an int in [0, {_MAX_SEED}]")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r}")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "a number in (0, 10]")
        if not _is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "a number in [-2, 2]")
        if not _is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "a number in [-2, 2]")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", "None or an int in [0, 20]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            # vLLM's -1 (the whole vocabulary) is over its default max_logprobs of 20 too.
            raise bad("prompt_logprobs", "None or an int in [0, 20] (-1, all tokens, is over 20)")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "None or a StructuredOutputsParams")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        ids = [t for t, _ in self.logit_bias]
        for token_id, bias in self.logit_bias:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}")
            if not _is_num(bias) or not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}"
                )
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias must give each token id once")

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def effective_top_k(self) -> int:
        """top_k with -1 normalised to 0 (off)."""
        return max(self.top_k, 0)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs sorted by id; values are checked later."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [tuple(item) for item in items]  # type: ignore[union-attr]
    except TypeError:
        raise ValueError(
            f"logit_bias must be a mapping of token ids to biases, got {value!r}"
        ) from None
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {value!r}")
    return tuple(
        sorted(pairs, key=lambda p: (0, p[0], "") if _is_int(p[0]) else (1, 0, repr(p[0])))
    )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: broadcasts a single one, checks a list's length."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return params
