"""Reasoning before the constrained answer: a matcher that lets a model think freely, then
hands over to the request's grammar.

A reasoning model (Qwen3, DeepSeek-R1 distills) writes ``<think> ... </think>`` before its
answer; gpt-oss (harmony) writes its analysis channel, then ``<|channel|>final<|message|>``
before the answer. The grammar must not constrain the thoughts, and must hold from the first
token of the answer: ``ReasoningMatcher`` wraps the request's matcher, allows every token but
the ends of sequence while the model thinks, and passes everything after the end of the thoughts
(one token, or a sequence of tokens) to the wrapped matcher. Once the reasoning budget is spent
it forces the end of the thoughts token by token (continuing a partly written end where the
thoughts stop inside one). Rollbacks (speculative drafts) may cross the switch either way.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baton.grammar.backend import GrammarMatcher, bitmask_width, token_bitmask_row

# What one accepted token of a ReasoningMatcher was (its rollback history).
_INNER, _FREE, _UNCOUNTED = 0, 1, 2


@dataclass(frozen=True)
class ReasoningSpec:
    """How one request reasons: the end-of-think token, whether its prompt left it thinking
    (False where the chat template closed the thoughts, e.g. thinking switched off), its
    budget of thinking tokens (None: unbounded) and the tokens it may not end on while
    thinking (the ends of sequence: a structured request must reach its answer).

    Where the thoughts end with a sequence of tokens (harmony's ``<|channel|>final<|message|>``)
    ``end_prefix`` holds the tokens before ``end_token_id``; ``forced_prefix`` is what the
    budget forces before that sequence when the thoughts stop outside it (harmony closes the
    analysis message first: ``<|end|><|start|>assistant``).

    Raises:
        ValueError: a negative budget or token id.
    """

    end_token_id: int
    thinking: bool = True
    max_tokens: int | None = None
    banned: tuple[int, ...] = ()
    end_prefix: tuple[int, ...] = ()
    forced_prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = (self.end_token_id, *self.end_prefix, *self.forced_prefix)
        if min(ids) < 0:
            raise ValueError(f"reasoning token ids must be >= 0, got {ids}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_reasoning_tokens must be >= 0, got {self.max_tokens}")

    @property
    def end(self) -> tuple[int, ...]:
        """The tokens that end the thoughts (the last one ``end_token_id``)."""
        return (*self.end_prefix, self.end_token_id)

    @property
    def forced(self) -> tuple[int, ...]:
        """The tokens a spent budget forces where the thoughts stop outside ``end``."""
        return (*self.forced_prefix, *self.end)


class ReasoningMatcher(GrammarMatcher):
    """``inner``'s grammar after the model's reasoning (``ReasoningSpec``): free tokens while
    thinking, the end of the thoughts (``spec.end``) switches to ``inner``."""

    def __init__(self, inner: GrammarMatcher, spec: ReasoningSpec, vocab_size: int) -> None:
        self.inner = inner
        self.spec = spec
        self.vocab_size = vocab_size
        self.thinking = spec.thinking
        # Thinking tokens the budget counts: all but those a spent budget forced and the one
        # that ends the thoughts.
        self.num_thinking_tokens = 0
        # Per accepted token: _FREE / _UNCOUNTED thinking tokens, or _INNER (the inner
        # grammar's); what rollback undoes. _thoughts: the thinking tokens themselves, whose
        # tail says how far into the end sequence the model is.
        self._history: list[int] = []
        self._thoughts: list[int] = []

    @property
    def budget_spent(self) -> bool:
        """Whether only the end of the thoughts may come next (the budget is used up)."""
        limit = self.spec.max_tokens
        return self.thinking and limit is not None and self.num_thinking_tokens >= limit

    def forced_token(self) -> int:
        """The one token a spent budget allows next: the next token of ``spec.end`` where the
        thoughts stop inside it, else of ``spec.forced`` (continued where they stop inside
        it), else ``spec.forced``'s first."""
        for seq in (self.spec.end, self.spec.forced):
            for k in range(min(len(seq) - 1, len(self._thoughts)), 0, -1):
                if self._thoughts[-k:] == list(seq[:k]):
                    return seq[k]
        return self.spec.forced[0]

    def _think(self, token: int) -> bool:
        """Takes a thinking token; False when it is not allowed here."""
        spent = self.budget_spent
        if spent and token != self.forced_token():
            return False
        if not spent and token in self.spec.banned and token != self.spec.end_token_id:
            return False
        if not 0 <= token < self.vocab_size:
            return False
        self._thoughts.append(token)
        end = self.spec.end
        ended = token == end[-1] and tuple(self._thoughts[-len(end) :]) == end
        counted = not (spent or ended)
        self.num_thinking_tokens += counted
        if ended:
            self.thinking = False
        self._history.append(_FREE if counted else _UNCOUNTED)
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
                self._history.extend([_INNER] * accepted)
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
            kind = self._history.pop()
            if kind == _INNER:
                inner += 1
                continue
            if inner:
                self.inner.rollback(inner)
                inner = 0
            self._thoughts.pop()
            self.thinking = True  # the last thinking token ended the thoughts, if any did
            self.num_thinking_tokens -= kind == _FREE
        if inner:
            self.inner.rollback(inner)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The inner grammar's row after the thoughts; while thinking every token but the
        ends of sequence, or only the forced token once the budget is spent."""
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
        self._thoughts.clear()

    def jump_forward_string(self) -> str:
        return "" if self.thinking else self.inner.jump_forward_string()


def fill_thinking_row(matcher: ReasoningMatcher, bitmask: torch.Tensor, row: int) -> None:
    """``bitmask[row]`` of a matcher that is thinking: every token of the vocabulary but the
    banned ones, or only ``forced_token()`` once the budget is spent."""
    spec = matcher.spec
    if matcher.budget_spent:
        allowed = token_bitmask_row((matcher.forced_token(),), matcher.vocab_size)
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


@dataclass(frozen=True)
class ReasoningTokens:
    """A reasoning parser's markers as token ids: ``start`` opens the thoughts, ``end`` (one
    token or more) closes them, ``forced_prefix`` is what a spent budget writes before ``end``
    (``ReasoningSpec``)."""

    start: int
    end: tuple[int, ...]
    forced_prefix: tuple[int, ...] = ()

    def thinks_first(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a completion of this prompt begins with thoughts: its template did not
        close them (no end of the thoughts after the last start)."""
        ids = list(prompt_token_ids)
        n = len(self.end)
        last_end = max(
            (i for i in range(len(ids) - n + 1) if tuple(ids[i : i + n]) == self.end), default=-1
        )
        last_start = max((i for i, t in enumerate(ids) if t == self.start), default=-1)
        return last_end <= last_start

    def spec(
        self, thinking: bool, max_tokens: int | None, banned: tuple[int, ...]
    ) -> ReasoningSpec:
        """The ``ReasoningSpec`` of one request with these markers."""
        return ReasoningSpec(
            self.end[-1], thinking, max_tokens, banned, self.end[:-1], self.forced_prefix
        )


_MARKER = re.compile(r"<[^<>]+>")


def reasoning_token_ids(
    tokenizer: Any, start: str, end: str, forced_prefix: str = ""
) -> ReasoningTokens:
    """The ids of ``start``, ``end`` and ``forced_prefix`` (e.g. ``<think>``, ``</think>``;
    harmony's ``<|channel|>final<|message|>``) in ``tokenizer``'s vocabulary (anything with
    ``encode(text, add_special_tokens=False)``); ``start`` and each ``<...>`` marker in them
    must be one token.

    Raises:
        ValueError: ``start`` or a marker is not a single token.
    """
    for text in (start, *_MARKER.findall(end + forced_prefix)):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"the reasoning parser needs {text!r} as one token of the model's vocabulary; "
                f"this tokenizer encodes it as {len(encoded)} tokens"
            )

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return ReasoningTokens(ids(start)[0], ids(end), ids(forced_prefix))
