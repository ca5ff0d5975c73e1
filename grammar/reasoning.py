"""Reasoning before the constrained answer: a matcher that lets a model think freely, then
hands over to the request's grammar.

A reasoning model (Qwen3, DeepSeek-R1 distills) writes ``<think> ... </think>`` before its
answer. The grammar must not constrain the thoughts, and must hold from the first token of the
answer: ``ReasoningMatcher`` wraps the request's matcher, allows every token but the ends of
sequence while the model thinks (only the end-of-think token once the reasoning budget is
spent, which forces the answer to begin), and passes everything after the end-of-think token to
the wrapped matcher. Rollbacks (speculative drafts) may cross the switch in either direction.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baton.grammar.backend import GrammarMatcher, bitmask_width, token_bitmask_row


@dataclass(frozen=True)
class ReasoningSpec:
    """How one request reasons: the end-of-think token, whether its prompt left it thinking
    (False where the chat template closed the thoughts, e.g. thinking switched off), its
    budget of thinking tokens (None: unbounded) and the tokens it may not end on while
    thinking (the ends of sequence: a structured request must reach its answer).

    Raises:
        ValueError: a negative budget or end token id.
    """

    end_token_id: int
    thinking: bool = True
    max_tokens: int | None = None
    banned: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.end_token_id < 0:
            raise ValueError(f"end_token_id must be >= 0, got {self.end_token_id}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_reasoning_tokens must be >= 0, got {self.max_tokens}")


class ReasoningMatcher(GrammarMatcher):
    """``inner``'s grammar after the model's reasoning (``ReasoningSpec``): free tokens while
    thinking, the end-of-think token switches to ``inner``."""

    def __init__(self, inner: GrammarMatcher, spec: ReasoningSpec, vocab_size: int) -> None:
        self.inner = inner
        self.spec = spec
        self.vocab_size = vocab_size
        self.thinking = spec.thinking
        self.num_thinking_tokens = 0
        # Per accepted token: True = a thinking token (the end token included), False = the
        # inner grammar's; what rollback undoes.
        self._history: list[bool] = []

    @property
    def budget_spent(self) -> bool:
        """Whether only the end-of-think token may come next (the budget is used up)."""
        limit = self.spec.max_tokens
        return self.thinking and limit is not None and self.num_thinking_tokens >= limit

    def _think(self, token: int) -> bool:
        """Takes a thinking token; False when it is not allowed here."""
        end = token == self.spec.end_token_id
        if not end and (self.budget_spent or token in self.spec.banned):
            return False
        if not 0 <= token < self.vocab_size:
            return False
        self.num_thinking_tokens += not end
        if end:
            self.thinking = False
        self._history.append(True)
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advances by the tokens: thoughts up to the end token, then the inner grammar's;
        False (and the state from the first rejected token on unchanged) on a rejection."""
        for i, token in enumerate(tokens):
            if self.thinking:
                if not self._think(token):
                    return False
                continue
            rest = tokens[i:]
            accepted = self.inner.validate_tokens(rest)
            if accepted:
                self.inner.accept_tokens(rest[:accepted])
                self._history.extend([False] * accepted)
            return accepted == len(rest)
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens would be accepted; the state does not change."""
        before = len(self._history)
        self.accept_tokens(tokens)
        accepted = len(self._history) - before
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens, across the end of thinking too."""
        if num_tokens > len(self._history):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens; only {len(self._history)} accepted"
            )
        inner = 0
        for _ in range(num_tokens):
            if not self._history.pop():
                inner += 1
                continue
            if inner:
                self.inner.rollback(inner)
                inner = 0
            if not self.thinking:  # the end token: back to thinking
                self.thinking = True
            else:
                self.num_thinking_tokens -= 1
        if inner:
            self.inner.rollback(inner)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The inner grammar's row after the thoughts; while thinking every token but the
        ends of sequence, or only the end-of-think token once the budget is spent."""
        if not self.thinking:
            self.inner.fill_bitmask(bitmask, row)
            return
        fill_thinking_row(self, bitmask, row)

    def is_terminated(self) -> bool:
        return not self.thinking and self.inner.is_terminated()

    def reset(self) -> None:
        self.inner.reset()
        self.thinking = self.spec.thinking
        self.num_thinking_tokens = 0
        self._history.clear()

    def jump_forward_string(self) -> str:
        return "" if self.thinking else self.inner.jump_forward_string()


def fill_thinking_row(matcher: ReasoningMatcher, bitmask: torch.Tensor, row: int) -> None:
    """``bitmask[row]`` of a matcher that is thinking: every token of the vocabulary but the
    banned ones, or only the end-of-think token once the budget is spent."""
    spec = matcher.spec
    if matcher.budget_spent:
        allowed = token_bitmask_row((spec.end_token_id,), matcher.vocab_size)
    else:
        allowed = _all_but(spec.banned, matcher.vocab_size)
    bitmask[row].zero_()
    bitmask[row, : allowed.numel()] = allowed


@functools.lru_cache(maxsize=16)
def _all_but(banned: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """An int32 bitmask row allowing every id below ``vocab_size`` but ``banned`` (cached: the
    same row for every thinking request of a model)."""
    row = torch.full((bitmask_width(vocab_size),), -1, dtype=torch.int32)
    if vocab_size % 32:
        last = (1 << (vocab_size % 32)) - 1
        row[-1] = last - (1 << 32) if last >= 1 << 31 else last
    for t in banned:
        if 0 <= t < vocab_size:
            word = int(row[t // 32]) & 0xFFFFFFFF & ~(1 << (t % 32))
            row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return row


def reasoning_token_ids(tokenizer: Any, start: str, end: str) -> tuple[int, int]:
    """The ids of ``start`` and ``end`` (e.g. ``<think>``, ``</think>``), each one token of
    ``tokenizer``'s vocabulary (anything with ``encode(text, add_special_tokens=False)``).

    Raises:
        ValueError: either is not a single token.
    """
    ids = []
    for text in (start, end):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"the reasoning parser needs {text!r} as one token of the model's vocabulary; "
                f"this tokenizer encodes it as {len(encoded)} tokens"
            )
        ids.append(encoded[0])
    return ids[0], ids[1]
