"""The small interface every structured-output backend implements."""

from __future__ import annotations

import abc
import importlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baton.grammar.spec import StructuredOutputsParams

# The native rest of a bitmask fill (GrammarBackend.plan_fill).
NativeFill = Callable[[], None]


def filled_now() -> None:
    """The rest of a fill that ``plan_fill`` did in full."""


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
        """Compiles (slow; runs in a compile worker process). Raises ``GrammarError``."""

    def compile_key(self, spec: StructuredOutputsParams) -> tuple[object, ...] | None:
        """What ``compile`` really compiles, when specs that differ compile to the same
        grammar (the compile service then compiles it once); None: the spec itself."""
        return None

    def export_compiled(self, compiled: CompiledGrammar) -> bytes:
        """Bytes from which ``import_compiled`` rebuilds ``compiled`` in another process
        (a compile worker exports, the engine imports). This default pickles it."""
        return pickle.dumps(compiled, protocol=pickle.HIGHEST_PROTOCOL)

    def import_compiled(self, spec: StructuredOutputsParams, data: bytes) -> CompiledGrammar:
        """Rebuilds the grammar that ``export_compiled`` turned into ``data``, for ``spec``,
        on this backend (the engine's copy of the one that compiled it).

        Raises:
            GrammarError: ``data`` cannot be turned back into a grammar.
        """
        grammar = pickle.loads(data)  # noqa: S301 - written by baton's own compile worker
        if not isinstance(grammar, CompiledGrammar):
            raise GrammarError(f"expected a compiled grammar, got {type(grammar).__name__}")
        return grammar

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fills ``bitmask[rows[i]]`` for ``matchers[i]``, all of this backend.

        Raises what ``plan_fill`` or the native fill raises.
        """
        self.plan_fill(matchers, bitmask, rows)()

    def plan_fill(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        off_thread: bool = False,
    ) -> NativeFill:
        """Does the Python side of filling ``bitmask[rows[i]]`` for ``matchers[i]`` now and
        returns the rest: a call that makes one native call, which releases the GIL while it
        runs, so another thread can run it beside Python work (the engine fills a step's
        mask beside scheduling the next one). Until that call returns, the matchers must not
        change and the rows must not be read. ``off_thread`` says the call will run on
        another thread: a backend then leaves it all the work it can, even where doing some
        here would be cheaper.

        The default fills every row now, one by one, and returns a call that does nothing;
        backends with a batched native fill override it.

        Raises:
            ValueError / TypeError: a bad bitmask or matcher (the returned call raises what
            the native fill raises).
        """
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)
        return filled_now


@dataclass(frozen=True)
class BackendRecipe:
    """How to build one backend: in the engine process, and again in each compile worker.

    Attributes:
        name: the backend's name in specs ("xgrammar", "outlines").
        target: ``"package.module:Class"``, called as ``Class(vocab, vocab_size, **options)``
            (an importable callable: compile workers import it by name).
        options: keyword arguments, as (name, value) pairs of plain picklable values.
        worker_options: options that differ in compile workers (e.g. one compile thread:
            workers run side by side instead).

    Raises:
        ValueError: ``target`` is not of the form "module:attribute".
    """

    name: str
    target: str
    options: tuple[tuple[str, Any], ...] = ()
    worker_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        module, _, attr = self.target.partition(":")
        if not module or not attr:
            raise ValueError(f"target must be 'module:attribute', got {self.target!r}")

    def for_workers(self) -> BackendRecipe:
        """This recipe with ``worker_options`` applied: what compile workers build."""
        options = {**dict(self.options), **dict(self.worker_options)}
        return BackendRecipe(self.name, self.target, tuple(options.items()))

    def build(self, vocab: object, vocab_size: int) -> GrammarBackend:
        """The backend, from a tokenizer or an already read ``Vocab``.

        Raises:
            ImportError, AttributeError: ``target`` does not name an importable callable.
        """
        module, _, attr = self.target.partition(":")
        factory = importlib.import_module(module)
        for part in attr.split("."):
            factory = getattr(factory, part)
        return factory(vocab, vocab_size, **dict(self.options))  # type: ignore[operator]


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def token_bitmask_row(tokens: Iterable[int], vocab_size: int) -> torch.Tensor:
    """One int32 bitmask row allowing exactly ``tokens`` (e.g. what a terminated matcher
    allows: the EOS ids)."""
    words = [0] * bitmask_width(vocab_size)
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    # int32 two's complement of each 32-bit word.
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask ``[rows, ceil(vocab_size / 32)]``."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)
