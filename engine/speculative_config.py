"""``SpeculativeConfig``: which drafter proposes draft tokens, and how many, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("grammar", "ngram", "auto")
# More drafts than this per step only add rows that a 135M-parameter model rarely accepts,
# and every one costs a bitmask row and a logits row.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: up to ``num_speculative_tokens`` draft tokens per request and step,
    verified in the step's one forward pass (greedy: the longest prefix equal to the masked
    argmax, plus one token; sampling: the same rule on the token the sampler draws at each
    position, which accepts a draft with its target probability and otherwise gives a token of
    the residual distribution). The output is exactly what the engine gives without drafts.

    Attributes:
        method: "grammar" (the canonical tokens of the text the grammar forces next; structured
            requests only), "ngram" (prompt lookup: the tokens that followed the last
            occurrence of the sequence's final n-gram, trimmed to what the grammar accepts), or
            "auto" (the grammar's forced tokens, then n-gram lookup for the rest).
        num_speculative_tokens: most draft tokens per request and step (1 to 16; default 5).
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first (vLLM's
            names), 1 <= min <= max <= 8.
        structured_only: draft for structured requests only (free text is served without
            drafts); what the engine's default, ``EngineConfig.structured_drafts``, turns on.
        adaptive: True (default): each step carries as many drafts per request, up to
            ``num_speculative_tokens``, as the step's measured cost per row and the drafts'
            measured acceptance say will pay (``engine/core/draft_policy.py``); False: always
            up to ``num_speculative_tokens``.

    Requests with repetition, presence or frequency penalties get drafts too: each draft
    position is penalised with the drafts before it counted as output tokens. Requests that ask
    for logprobs get one entry per kept token, each from the row of its position (the
    distribution a step without drafts has there).

    Raises:
        ValueError: naming the field that is wrong.
    """

    method: str = "auto"
    # 5 by measurement (`baton bench spec --modes off,auto --num-speculative-tokens K`, bfloat16,
    # 2026-12-04, one run each, auto/off): k=3 peers 1.47 at concurrency 1 and 1.20 at 16,
    # extraction 1.99 and 1.25; k=5 peers 2.05 and 1.31, extraction 2.40 and 1.28; k=7 no more
    # tokens per step than k=5 (peers 2.22 vs 2.20 at concurrency 1) and more rejected rows.
    # Measured while bfloat16 steps of 1-2 rows took int8 weights by default (now only with
    # quantization="int8"): with the dense GEMMs on packed weights, a verification step of 3
    # to 8 rows cost about what one of 2 rows did on the int8 kernel (models/quant.py), so
    # drafts past the third were nearly free at batch 1.
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    structured_only: bool = False
    adaptive: bool = True

    def __post_init__(self) -> None:
        for name in ("structured_only", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"speculative_config.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an int in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= 8:
                raise ValueError(f"speculative_config.{name} must be an int in 1..8, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )

    @property
    def uses_grammar(self) -> bool:
        """Whether the grammar's forced continuation is drafted."""
        return self.method in ("grammar", "auto")

    @property
    def uses_ngram(self) -> bool:
        """Whether prompt lookup is drafted."""
        return self.method in ("ngram", "auto")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict (vLLM's ``speculative_config={"method": ..., ...}``) or
        its JSON text (the ``--speculative-config`` flag); None stays None.

        Raises:
            ValueError: text that is not a JSON object, an unknown key, or a bad value.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a SpeculativeConfig, a dict or a JSON object, "
                f"got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
