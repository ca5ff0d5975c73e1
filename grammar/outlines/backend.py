"""The outlines-core backend: regex, choice and JSON-schema constraints as a token-level DFA index.

outlines-core turns a JSON schema into one regular expression and that regex into an ``Index``
(DFA state x token -> state) over the model's vocabulary. It takes the schemas its converter
writes faithfully: ``grammar/outlines/faithful.py`` walks a schema as the converter does,
names what it would ignore (refused unless the request sets ``allow_unenforced``) and refuses
what it cannot write; ``auto`` then passes the schema on to the next backend. The enforcement
table is ``grammar/outlines/keywords.py``.

Choices made here:
  * Sound before complete: where outlines writes fewer instances than a schema has (only listed
    properties, in schema order; string text without \\u escapes; nested any-values at most
    three levels deep) the schema is taken.
  * json_object is outlines' own depth-bounded "any object" regex: containers nest at most three
    levels deep (deeper objects are rejected, never produced); compiling it takes seconds.
  * Specs whose regex or DFA would be huge are refused (memory: about 1 MB per DFA state).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from baton.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    bitmask_width,
)
from baton.grammar.outlines.faithful import check_outlines_schema
from baton.grammar.outlines.keywords import (
    OUTLINES_CONDITIONAL_KEYWORDS,
    OUTLINES_ENFORCED_KEYWORDS,
    OUTLINES_UNENFORCED_KEYWORDS,
)
from baton.grammar.schema.pattern_regex import (
    choice_regex,
    estimate_dfa_states,
    regex_literal,
    strip_anchors,
)
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.vocab import Vocab, VocabSource, build_vocab

DEFAULT_MAX_STATES = 4000
"""Refuse regexes whose estimated DFA size exceeds this: the outlines index holds every state's
transitions over the whole vocabulary (about 1 MB per state for a 49k vocabulary, measured), and
a counted repetition such as maxLength 1000 would take gigabytes."""

_MAX_JUMP_FORWARD_BYTES = 4096


def whitespace_pattern(whitespace: str, max_whitespace_cnt: int) -> str:
    """The regex outlines puts between JSON tokens: none for "compact", else at most
    ``max_whitespace_cnt`` spaces, newlines or tabs."""
    if whitespace == "compact":
        return ""
    return f"[ \\n\\t]{{0,{max_whitespace_cnt}}}"


DEFAULT_MAX_REGEX_CHARS = 1 << 20
"""Refuse schemas whose regex would be longer (outlines would spend seconds and gigabytes
writing it before the DFA size check could even run)."""


@lru_cache(maxsize=256)
def _spec_regex(kind: str, spec_text: str, options: tuple[Any, ...], allow_unenforced: bool) -> str:
    whitespace, max_ws, open_objects = options
    ws = whitespace_pattern(whitespace, max_ws)
    if kind == "regex":
        return strip_anchors(spec_text)
    if kind == "choice":
        return choice_regex(json.loads(spec_text))
    if kind == "json_object":
        return build_regex_from_schema('{"type": "object"}', ws)
    if kind == "json":
        checked = check_outlines_schema(json.loads(spec_text), ws, open_objects)
        if checked.error is not None:
            raise GrammarError(f"outlines-core cannot take this schema: {checked.error}")
        if open_objects and checked.open_with_properties:
            # Never narrowed silently to the declared names, lenient or not.
            raise GrammarError(
                "outlines-core cannot honour open_objects: it writes only an object's declared "
                "properties (use xgrammar or guidance, or closed objects)"
            )
        if checked.unenforced and not allow_unenforced:
            raise GrammarError(
                "outlines-core would not enforce these schema keywords: "
                + ", ".join(checked.unenforced)
                + " (set allow_unenforced to accept the schema with them ignored)"
            )
        if checked.regex_chars > DEFAULT_MAX_REGEX_CHARS:
            raise GrammarError(
                f"outlines-core would write a regex of about {checked.regex_chars} characters "
                f"for this schema (limit {DEFAULT_MAX_REGEX_CHARS}); use another backend"
            )
        try:
            return build_regex_from_schema(json.dumps(checked.schema), ws)
        except Exception as exc:  # outlines raises ValueError and PyO3 errors
            raise GrammarError(f"outlines-core cannot convert this schema: {exc}") from None
    raise GrammarError(
        f"outlines-core does not support {kind} constraints (use the xgrammar backend)"
    )


# ---------------------------------------------------------------------------------------------
# Backend, compiled grammar, matcher


@dataclass(frozen=True)
class _VocabInfo:
    """What every matcher of one backend shares."""

    token_bytes: tuple[bytes, ...]
    bytes_to_id: dict[bytes, int]
    eos_ids: frozenset[int]
    outlines_eos: int
    vocab_size: int


class OutlinesCompiledGrammar(CompiledGrammar):
    """An outlines-core ``Index`` plus the vocabulary facts matchers need."""

    backend_name = "outlines"

    def __init__(self, index: Any, regex: str, info: _VocabInfo) -> None:
        self.index = index
        self.regex = regex
        self._info = info

    def new_matcher(self) -> OutlinesMatcher:
        """A fresh matcher at the grammar's start."""
        return OutlinesMatcher(self.index, self._info)


_GUIDE_ROLLBACK = 64


class OutlinesMatcher(GrammarMatcher):
    """Walks an outlines ``Index``; an outlines ``Guide`` follows along to write bitmasks.

    EOS is accepted only at an accepting state and then terminates the matcher; special tokens
    and ids outside the tokenizer are never accepted.
    """

    def __init__(self, index: Any, info: _VocabInfo) -> None:
        self._index = index
        self._info = info
        self._guide = outlines_core.Guide(index, max_rollback=_GUIDE_ROLLBACK)
        self._tokens: list[int] = []
        self._terminated = False

    def _step(self, state: int, token: int) -> int | None:
        if token in self._info.eos_ids or not 0 <= token < self._info.vocab_size:
            return None
        if token == self._info.outlines_eos:
            return None
        return self._index.get_next_state(state, token)

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advances by each token in turn; returns False at the first one not allowed (the
        tokens before it stay accepted)."""
        for token in tokens:
            token = int(token)
            if self._terminated:
                return False
            state = self._guide.get_state()
            if token in self._info.eos_ids:
                if not self._index.is_final_state(state):
                    return False
                self._terminated = True
                self._tokens.append(token)
                continue
            if self._step(state, token) is None:
                return False
            self._guide.advance(token, return_tokens=False)
            self._tokens.append(token)
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens would be accepted; the state does not change."""
        if self._terminated:
            return 0
        state: int | None = self._guide.get_state()
        for count, token in enumerate(tokens):
            token = int(token)
            assert state is not None
            if token in self._info.eos_ids:
                return count + 1 if self._index.is_final_state(state) else count
            state = self._step(state, token)
            if state is None:
                return count
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: more tokens than were accepted, or a negative count.
        """
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {len(self._tokens)} were accepted"
            )
        if num_tokens == 0:
            return
        if self._terminated:
            self._terminated = False
            self._tokens.pop()
            num_tokens -= 1
        if num_tokens == 0:
            return
        del self._tokens[-num_tokens:]
        if num_tokens <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(num_tokens)
        else:
            self._guide = outlines_core.Guide(self._index, max_rollback=_GUIDE_ROLLBACK)
            for token in self._tokens:
                self._guide.advance(token, return_tokens=False)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed-next-token bits into ``bitmask[row]`` (int32, bit j of word w is
        token 32*w+j). A terminated matcher allows only EOS.

        Raises:
            ValueError: the bitmask is not a CPU int32 tensor wide enough for the vocabulary.
        """
        width = bitmask_width(self._info.vocab_size)
        if (
            bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu"
            or bitmask.dim() != 2
            or bitmask.shape[1] < width
        ):
            raise ValueError(
                f"bitmask must be a CPU int32 tensor [rows, >= {width}], got "
                f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        line = bitmask[row]
        if not line.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        words = line.numpy().view(np.uint32)
        if self._terminated:
            words[:] = 0
            final = True
        else:
            self._guide.write_mask_into(line.data_ptr(), line.numel(), 4)
            final = self._index.is_final_state(self._guide.get_state())
        outlines_eos = self._info.outlines_eos
        if outlines_eos not in self._info.eos_ids and outlines_eos < 32 * words.size:
            words[outlines_eos >> 5] &= np.uint32(~(1 << (outlines_eos & 31)) & 0xFFFFFFFF)
        for eos in self._info.eos_ids:
            bit = np.uint32(1 << (eos & 31))
            if final:
                words[eos >> 5] |= bit
            else:
                words[eos >> 5] &= ~bit

    def is_terminated(self) -> bool:
        """True once EOS was accepted at an accepting state."""
        return self._terminated

    def reset(self) -> None:
        """Back to the initial state."""
        self._guide = outlines_core.Guide(self._index, max_rollback=_GUIDE_ROLLBACK)
        self._tokens.clear()
        self._terminated = False

    def jump_forward_string(self) -> str:
        """The text every continuation starts with (the longest common prefix of the allowed
        tokens, followed through the DFA while that prefix is itself a token); empty at an
        accepting state."""
        if self._terminated:
            return ""
        info = self._info
        state: int | None = self._guide.get_state()
        out = b""
        while state is not None and len(out) < _MAX_JUMP_FORWARD_BYTES:
            if self._index.is_final_state(state):
                break
            allowed = [
                t
                for t in self._index.get_allowed_tokens(state)
                if t not in info.eos_ids and t != info.outlines_eos and t < len(info.token_bytes)
            ]
            if not allowed:
                break
            texts = [info.token_bytes[t] for t in allowed]
            lo, hi = min(texts), max(texts)
            size = 0
            while size < min(len(lo), len(hi)) and lo[size] == hi[size]:
                size += 1
            if size == 0:
                break
            prefix = lo[:size]
            out += prefix
            token = info.bytes_to_id.get(prefix)
            if token is None or token not in set(allowed):
                break
            state = self._index.get_next_state(state, token)
        for cut in range(len(out), max(len(out) - 4, -1), -1):
            try:
                return out[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""


class OutlinesBackend(GrammarBackend):
    """outlines-core: regex, choice, json (schema) and json_object (depth-bounded) constraints.

    Args:
        tokenizer: the baton ``Tokenizer`` (anything ``build_vocab`` reads).
        vocab_size: the model's vocabulary size; ids at or above it, special tokens and EOS are
            left out of outlines' vocabulary (EOS is handled by the matcher).
        max_states: refuse specs whose estimated DFA exceeds this many states.

    Raises:
        ValueError: vocab_size is not a positive int, or the tokenizer has neither an EOS nor
            another special token below vocab_size (outlines needs an id for its EOS).
    """

    name = "outlines"

    def __init__(
        self, tokenizer: VocabSource, vocab_size: int, max_states: int = DEFAULT_MAX_STATES
    ) -> None:
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.max_states = max_states
        vocab: Vocab = build_vocab(tokenizer)
        self.vocab = vocab
        eos_ids = frozenset(e for e in vocab.eos_token_ids if 0 <= e < vocab_size)
        reserved = sorted(eos_ids) or sorted(i for i in vocab.special_ids if i < vocab_size)
        if not reserved:
            raise ValueError(
                "the outlines backend needs an EOS or special token id below vocab_size"
            )
        mapping: dict[bytes, list[int]] = {}
        bytes_to_id: dict[bytes, int] = {}
        limit = min(vocab.size, vocab_size)
        for token_id in range(limit):
            text = vocab.token_bytes[token_id]
            if token_id in vocab.special_ids or token_id in eos_ids or not text:
                continue
            mapping.setdefault(text, []).append(token_id)
            bytes_to_id.setdefault(text, token_id)
        self._vocabulary = outlines_core.Vocabulary(reserved[0], mapping)
        self._info = _VocabInfo(
            token_bytes=vocab.token_bytes[:limit],
            bytes_to_id=bytes_to_id,
            eos_ids=eos_ids,
            outlines_eos=reserved[0],
            vocab_size=vocab_size,
        )

    def regex_for(self, spec: StructuredOutputsParams) -> str:
        """The regex outlines would compile for ``spec`` (cheap: no index is built).

        Raises:
            GrammarError: why outlines cannot take or fully enforce the spec.
        """
        try:
            # Not spec_text for json: that sorts keys, and outlines writes properties in schema
            # order.
            spec_text = json.dumps(spec.schema) if spec.kind == "json" else spec.spec_text
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        regex = _spec_regex(spec.kind, spec_text, spec.options_key, spec.allow_unenforced)
        states = estimate_dfa_states(regex)
        if states > self.max_states:
            raise GrammarError(
                f"outlines-core would build a DFA of about {states} states (limit "
                f"{self.max_states}); lower length/item bounds or use the xgrammar backend"
            )
        return regex

    def compile_key(self, spec: StructuredOutputsParams) -> tuple[object, ...] | None:
        """The regex: schemas that outlines writes as the same regex share one index
        (e.g. every schema that allows any JSON value, seconds to build each time)."""
        try:
            return ("regex", self.regex_for(spec))
        except GrammarError:
            return None

    def unsupported_reason(self, spec: StructuredOutputsParams) -> str | None:
        """None when outlines can take and fully enforce ``spec``; otherwise why not."""
        try:
            self.regex_for(spec)
        except GrammarError as exc:
            return str(exc)
        return None

    def compile(self, spec: StructuredOutputsParams) -> OutlinesCompiledGrammar:
        """Builds the outlines index for ``spec`` (seconds for large schemas).

        Raises:
            GrammarError: the spec is unsupported, not fully enforceable (unless
                allow_unenforced), or outlines fails to build it.
        """
        regex = self.regex_for(spec)
        try:
            index = outlines_core.Index(regex, self._vocabulary)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # PyO3 panics derive from BaseException
            raise GrammarError(f"outlines-core cannot compile this {spec.kind}: {exc}") from None
        return OutlinesCompiledGrammar(index, regex, self._info)

    def export_compiled(self, compiled: CompiledGrammar) -> bytes:
        """The index (outlines-core's own binary form, through pickle) and its regex.

        Raises:
            TypeError: ``compiled`` is not an ``OutlinesCompiledGrammar``.
        """
        if not isinstance(compiled, OutlinesCompiledGrammar):
            raise TypeError(f"expected an OutlinesCompiledGrammar, got {type(compiled).__name__}")
        return pickle.dumps((compiled.index, compiled.regex), protocol=pickle.HIGHEST_PROTOCOL)

    def import_compiled(
        self, spec: StructuredOutputsParams, data: bytes
    ) -> OutlinesCompiledGrammar:
        """Rebuilds the index that ``export_compiled`` wrote (no DFA is built again).

        Raises:
            GrammarError: ``data`` does not hold an outlines index.
        """
        try:
            index, regex = pickle.loads(data)  # noqa: S301 - written by baton's compile worker
        except (pickle.UnpicklingError, ValueError, TypeError, EOFError) as exc:
            raise GrammarError(f"cannot read the compiled outlines index: {exc}") from None
        if not isinstance(index, outlines_core.Index):
            raise GrammarError(f"expected an outlines index, got {type(index).__name__}")
        return OutlinesCompiledGrammar(index, regex, self._info)


__all__ = [
    "DEFAULT_MAX_REGEX_CHARS",
    "DEFAULT_MAX_STATES",
    "OUTLINES_CONDITIONAL_KEYWORDS",
    "OUTLINES_ENFORCED_KEYWORDS",
    "OUTLINES_UNENFORCED_KEYWORDS",
    "OutlinesBackend",
    "OutlinesCompiledGrammar",
    "OutlinesMatcher",
    "choice_regex",
    "estimate_dfa_states",
    "regex_literal",
    "whitespace_pattern",
]
