"""The small interface every structured-output backend implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from baton.grammar.spec import StructuredOutputsParams


class GrammarError(ValueError):
    """A spec a backend cannot take (syntax, unsupported feature), or a compile failure."""


class GrammarMatcher(abc.ABC):
    """Per-request matcher state: which tokens may come next.

    Token ids are model vocabulary ids; the EOS token is accepted only where
    the grammar may end, and accepting it terminates the matcher.
    """

    @abc.abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advances by the tokens; False (and state unchanged from the first
        rejected token on) when one is not allowed."""

    @abc.abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens would be accepted; the state does not change."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed-next-token bits into ``bitmask[row]`` (int32, 1 = allowed)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has ended (EOS accepted at an accepting state)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the initial state."""

    @abc.abstractmethod
    def jump_forward_string(self) -> str:
        """The text forced from here on (may be empty)."""


class CompiledGrammar(abc.ABC):
    """A compiled spec; cheap to make matchers from, shared between requests."""

    backend_name: str

    @abc.abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(abc.ABC):
    """Compiles specs for one tokenizer vocabulary.

    Args (of implementations): the baton ``Tokenizer`` and ``vocab_size``,
    the model's vocabulary size (the bitmask width is ceil(vocab_size / 32);
    ids the tokenizer does not have are never allowed).
    """

    name: str

    @abc.abstractmethod
    def unsupported_reason(self, spec: StructuredOutputsParams) -> str | None:
        """None when this backend can take and fully enforce ``spec``; otherwise
        why not (unsupported kind, keywords it would silently ignore)."""

    @abc.abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compiles (slow; runs in a worker thread). Raises ``GrammarError``."""

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fills ``bitmask[rows[i]]`` for ``matchers[i]``, all of this backend.

        Backends override this to batch the work into few native calls.
        """
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask ``[rows, ceil(vocab_size / 32)]``."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)
