"""The ``guidance`` backend: llguidance (the Rust engine behind Guidance, vLLM's ``guidance``
backend) for JSON schemas, regexes, choices and EBNF grammars.

llguidance builds no token-mask tables ahead of time: its Earley parser walks the tokenizer's
token trie at each step under fixed work limits, so a compile is the translation of the spec
into its grammar text plus one parser the engine copies for each request (milliseconds), and any
schema gets masks in bounded time. It refuses
JSON-schema keywords it does not implement (``uniqueItems``, ``not``, ``if``/``then``, overlapping
``oneOf``, ...) with its own message naming them, so it never ignores a constraint silently; with
``allow_unenforced`` it is asked to be lenient, as the other backends then are.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from baton.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    NativeFill,
    bitmask_width,
    filled_now,
    token_bitmask_row,
)
from baton.grammar.schema.normalise import (
    disjoint_one_of_as_any_of,
    drop_unknown_formats,
    integral_counts,
    object_policy,
)
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.vocab import Vocab, VocabSource

# Kinds llguidance takes. Structural tags stay with xgrammar (its own format).
_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# llguidance's option that keeps its masks to the grammar: by default, where the grammar
# forces bytes its mask allows only the first token of their canonical tokenization, while
# its matcher takes any tokens that spell them (see ``without_forcing``).
_NO_FORCING = '%llguidance {"no_forcing": true}'


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _one_line(messages: Sequence[str], limit: int = 400) -> str:
    """llguidance's messages on one line (they quote the source with carets over lines)."""
    text = " ".join(" ".join(messages).split())
    return (text[: limit - 3] + "...") if len(text) > limit else (text or "rejected the grammar")


def guidance_normal_form(schema: Any) -> Any:
    """``schema`` in the shape baton hands llguidance, with the same instances: integral
    counts as ints, formats JSON Schema does not define dropped (annotations, which llguidance
    would refuse as unknown), and provably disjoint ``oneOf`` as ``anyOf`` (llguidance refuses
    every ``oneOf`` it cannot prove exclusive itself)."""
    return disjoint_one_of_as_any_of(drop_unknown_formats(integral_counts(schema)))


def without_forcing(grammar: str) -> str:
    """llguidance's grammar text ``grammar`` (Lark, or its JSON of grammars) with forcing off.

    Where a grammar forces bytes (a const, an enum's only continuation, a property name),
    llguidance's mask allows by default only the first token of the forced text's canonical
    tokenization (``{"`` but not ``{``, ``hello`` but not ``hell``), while its matcher accepts
    every token that spells the text. The mask and ``accept_tokens`` then disagreed (12 walked
    tokens in the grammar bench on the shared schemas), and drafts that spell forced text
    another way were refused by the mask only. With ``no_forcing`` the mask is the grammar's,
    as xgrammar's and outlines-core's are; the forced text is still reported
    (``compute_ff_bytes``) for jump-forward drafts. A JSON-schema grammar becomes Lark's
    ``start: %json {...}`` of the same schema and options; Lark text gets the option on a last
    line (its lines keep their numbers in messages).
    """
    if not grammar.lstrip().startswith("{"):
        return f"{grammar}\n{_NO_FORCING}\n"
    top = json.loads(grammar)
    for entry in top.get("grammars", ()):
        if entry.get("lark_grammar") is not None:
            entry["lark_grammar"] = f"{entry['lark_grammar']}\n{_NO_FORCING}\n"
        elif entry.get("json_schema") is not None:
            schema = json.dumps(entry.pop("json_schema"), ensure_ascii=False)
            entry["lark_grammar"] = f"start: %json {schema}\n{_NO_FORCING}\n"
    return json.dumps(top, ensure_ascii=False)


# llguidance.torch's fill helpers, without importing that module: it decorates a function
# with torch.compile at import, which imports dynamo and inductor (about 3 s of CPU in every
# process that loads this backend: the engine, each compile-worker template).
def _check_layout(bitmask: torch.Tensor) -> None:
    """llguidance writes through a raw pointer: the tensor must be what it assumes.

    Raises:
        ValueError: not a contiguous 2-D int32 CPU tensor.
    """
    if not (
        bitmask.dtype == torch.int32
        and bitmask.device.type == "cpu"
        and bitmask.dim() == 2
        and bitmask.is_contiguous()
    ):
        raise ValueError(
            "bitmask must be a contiguous 2-D int32 CPU tensor, got "
            f"{bitmask.dtype} {list(bitmask.shape)} on {bitmask.device}"
        )


def _fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Writes ``matcher``'s mask into row ``row`` of ``bitmask``, which the caller has checked
    with ``_check_layout`` (once per fill call, not once per row)."""
    view = bitmask[row]
    matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())


def _fill_rows(
    executor: llguidance.LLExecutor,
    matchers: list[tuple[llguidance.LLMatcher, int]],
    bitmask: torch.Tensor,
) -> None:
    """Writes each (matcher, row)'s mask into the contiguous int32 CPU ``bitmask``, on the
    executor's threads."""
    _check_layout(bitmask)
    if any(not 0 <= row < bitmask.shape[0] for _, row in matchers):
        raise IndexError(f"a bitmask row is outside [0, {bitmask.shape[0]})")
    executor.unsafe_compute_mask_ptr(
        matchers, bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(), bitmask.shape[0]
    )


class GuidanceCompiledGrammar(CompiledGrammar):
    """llguidance's grammar text for one spec, and a matcher at its start that every
    request's matcher is copied from.

    Building an llguidance matcher parses the grammar (4 ms at the median of the shared
    schemas, over 200 ms for the largest); copying one takes ~50 us. ``prepare`` builds the
    first one; the engine calls it off its own thread (``import_compiled``), so admitting a
    request costs only the copy.
    """

    backend_name = "guidance"

    def __init__(self, grammar: str, backend: GuidanceBackend, kind: str) -> None:
        self.grammar = grammar
        self.backend = backend
        self.kind = kind
        self._lock = threading.Lock()
        self._start: llguidance.LLMatcher | None = None

    def memory_size_bytes(self) -> int:
        # llguidance reports no size. Its start parser measured up to ~20x the grammar text
        # in resident memory (320 kB for a 16 kB grammar); count 32x so the cache's byte
        # budget is not overrun by guidance entries.
        return 32 * len(self.grammar)

    def prepare(self) -> None:
        """Builds the start matcher now if it is not built yet; thread-safe.

        Raises:
            GrammarError: llguidance cannot build a parser for the grammar.
        """
        with self._lock:
            if self._start is None:
                self._start = self.backend.new_llmatcher(self.grammar)

    def new_matcher(self) -> GuidanceMatcher:
        self.prepare()
        assert self._start is not None
        return GuidanceMatcher(self._start.deep_copy(), self.backend)


class GuidanceMatcher(GrammarMatcher):
    """One request's llguidance matcher. llguidance stops by itself once nothing may follow;
    baton's matcher terminates only when an EOS token is accepted there (``is_terminated``),
    so that rollback and EOS handling match the other backends.

    Its grammars are built with forcing off (``without_forcing``), so the mask allows exactly
    the tokens ``accept_tokens`` takes, forced text in any tokenization included.
    """

    def __init__(self, matcher: llguidance.LLMatcher, backend: GuidanceBackend) -> None:
        self.ll = matcher
        self._backend = backend
        self._terminated = False
        # llguidance keeps an EOS in its history (for rollback) only when it had not already
        # stopped by itself before it.
        self._eos_in_history = False

    def _accept(self, token: int) -> bool:
        if self._terminated or self._backend.never_allowed(token):
            return False
        if token in self._backend.eos_token_ids:
            if not self.ll.is_accepting():
                return False
            if self.ll.is_stopped():
                self._eos_in_history = False
            else:
                self._eos_in_history = bool(self.ll.consume_token(token))
                if not self._eos_in_history:
                    return False
            self._terminated = True
            return True
        # try_consume_tokens stops before a token the grammar refuses, leaving the state as
        # it was (consume_token would put the matcher in its error state for good).
        return self.ll.try_consume_tokens([token]) == 1

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        return all(self._accept(int(token)) for token in tokens)

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        count = 0
        for token in tokens:
            if not self._accept(int(token)):
                break
            count += 1
        self.rollback(count)
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:
            self._terminated = False
            if not self._eos_in_history:
                num_tokens -= 1
        if num_tokens > 0:
            self.ll.rollback(num_tokens)
        if self.ll.is_error():
            raise GrammarError(f"llguidance rollback failed: {self.ll.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            bitmask[row].copy_(self._backend.eos_row)
            return
        _check_layout(bitmask)
        _fill_row(self.ll, bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self.ll.reset()
        self._terminated = False
        self._eos_in_history = False

    def jump_forward_string(self) -> str:
        if self._terminated:
            return ""
        return self.ll.compute_ff_bytes().decode("utf-8", "ignore")


class GuidanceBackend(GrammarBackend):
    """Compiles JSON schemas, regexes, choices and EBNF grammars with llguidance.

    Args:
        tokenizer: baton's ``Tokenizer``, or a ``Vocab`` read from one (matchers need its
            ``tokenizer_json``; compiling, which only translates specs, does not).
        vocab_size: the model's vocabulary size (the bitmask width is ceil(vocab_size / 32)).
        fill_threads: threads of llguidance's batched mask fill (it releases the GIL).
        parallel_fill_min_rows: batches with fewer rows are filled row by row on this thread.

    Raises:
        ValueError: vocab_size, fill_threads or parallel_fill_min_rows < 1.
    """

    name = "guidance"

    def __init__(
        self,
        tokenizer: VocabSource | Vocab,
        vocab_size: int,
        *,
        fill_threads: int = 2,
        parallel_fill_min_rows: int = 32,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if fill_threads < 1:
            raise ValueError(f"fill_threads must be >= 1, got {fill_threads}")
        if parallel_fill_min_rows < 1:
            raise ValueError(f"parallel_fill_min_rows must be >= 1, got {parallel_fill_min_rows}")
        self.vocab_size = vocab_size
        self._tokenizer_json: str | None = (
            tokenizer.tokenizer_json if isinstance(tokenizer, Vocab) else tokenizer.backend.to_str()  # type: ignore[attr-defined]
        )
        eos = tokenizer.eos_token_ids
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        special = (
            tokenizer.special_ids if isinstance(tokenizer, Vocab) else tokenizer.all_special_ids
        )
        self._never = frozenset(special) - self.eos_token_ids
        self._fill_threads = fill_threads
        self._parallel_min_rows = parallel_fill_min_rows
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executors: dict[int, llguidance.LLExecutor] = {}  # by thread count
        # What a terminated matcher allows, like the other backends: EOS only.
        self.eos_row = token_bitmask_row(self.eos_token_ids, vocab_size)
        # The last bitmask plan_fill checked, with its first row's address and row bytes.
        self._checked: torch.Tensor | None = None
        self._row_ptr = (0, 0, 0)

    # ------------------------------------------------------------- tokenizer
    def _llt(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use (about 1 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer_json is None:
                    raise GrammarError(
                        "the guidance backend needs the tokenizer's JSON to build matchers"
                    )
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json,
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self.eos_token_ids),
                )
            return self._ll_tokenizer

    def new_llmatcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the start of ``grammar``.

        Raises:
            GrammarError: llguidance cannot build a parser for it.
        """
        matcher = llguidance.LLMatcher(self._llt(), grammar)
        if matcher.is_error():
            raise GrammarError(f"llguidance cannot use the grammar: {matcher.get_error()}")
        return matcher

    def never_allowed(self, token: int) -> bool:
        """True for ids no grammar may produce: out of range and control tokens."""
        return not 0 <= token < self.vocab_size or token in self._never

    # --------------------------------------------------------------- compile
    def _json_defaults(self, spec: StructuredOutputsParams) -> dict[str, Any]:
        options: dict[str, Any] = {"lenient": spec.allow_unenforced}
        if spec.whitespace == "any":
            options["whitespace_flexible"] = False
            options["whitespace_pattern"] = rf"[ \t\n\r]{{0,{spec.max_whitespace_cnt}}}"
            options["item_separator"] = ","
            options["key_separator"] = ":"
        else:
            options["whitespace_flexible"] = False
            options["item_separator"] = ","
            options["key_separator"] = ":"
        return options

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        """llguidance's grammar text for ``spec`` (not yet checked), as llguidance writes it
        (``compile`` turns its forcing off).

        Raises:
            GrammarError: a kind llguidance does not take, or an EBNF grammar that cannot be
                read as Lark.
            ValueError: the schema text is not JSON.
        """
        kind = spec.kind
        matcher = llguidance.LLMatcher
        if kind == "json":
            schema = spec.schema
            # llguidance reads schemas as JSON Schema does (open objects): closed ones are
            # written out unless the request asked for open objects.
            schema = guidance_normal_form(object_policy(schema, spec.open_objects))
            return matcher.grammar_from_json_schema(schema, defaults=self._json_defaults(spec))
        if kind == "json_object":
            return matcher.grammar_from_json_schema(
                {"type": "object"}, defaults=self._json_defaults(spec)
            )
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex or "")
        if kind == "choice":
            alternatives = " | ".join(_lark_string(c) for c in spec.choice or ())
            return matcher.grammar_from_lark(f"start: {alternatives}")
        if kind == "grammar":
            try:
                lark = any_to_lark(spec.grammar or "")
            except Exception as exc:  # noqa: BLE001 - the converter raises several types
                raise GrammarError(f"llguidance cannot read the EBNF grammar: {exc}") from None
            return matcher.grammar_from_lark(lark)
        raise GrammarError(f"the guidance backend does not take {kind} specs")

    def _check(self, grammar: str) -> None:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if failed:
            raise GrammarError(f"llguidance: {_one_line(messages)}")

    def unsupported_reason(self, spec: StructuredOutputsParams) -> str | None:
        """None when llguidance takes ``spec`` whole; otherwise its reason (a kind it does not
        take, keywords it does not implement, a regex feature the Rust engine lacks)."""
        if spec.kind not in _KINDS:
            return f"the guidance backend does not take {spec.kind} specs"
        try:
            self._check(self.grammar_text(spec))
        except GrammarError as exc:
            return str(exc)
        except (ValueError, TypeError) as exc:
            return f"llguidance: {exc}"
        return None

    def compile(self, spec: StructuredOutputsParams) -> GuidanceCompiledGrammar:
        """Translates and checks ``spec``; thread-safe and fast (no token tables). The grammar
        kept is the checked one with forcing off (``without_forcing``), so that its masks allow
        what its matchers accept; the check reads the text as written, whose messages quote
        the user's own grammar.

        Raises:
            GrammarError: llguidance rejects the spec; the message holds its reason.
        """
        try:
            grammar = self.grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"llguidance cannot compile the {spec.kind} spec: {exc}") from None
        self._check(grammar)
        return GuidanceCompiledGrammar(without_forcing(grammar), self, spec.kind)

    def export_compiled(self, compiled: CompiledGrammar) -> bytes:
        """The grammar text (what a matcher is built from).

        Raises:
            TypeError: ``compiled`` is not a ``GuidanceCompiledGrammar``.
        """
        if not isinstance(compiled, GuidanceCompiledGrammar):
            raise TypeError(f"expected a GuidanceCompiledGrammar, got {type(compiled).__name__}")
        return compiled.grammar.encode("utf-8")

    def import_compiled(
        self, spec: StructuredOutputsParams, data: bytes
    ) -> GuidanceCompiledGrammar:
        """The grammar ``export_compiled`` wrote, with its start matcher built (``prepare``).

        Raises:
            GrammarError: the text is not UTF-8, or llguidance cannot build a parser for it.
        """
        try:
            grammar = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GrammarError(f"guidance grammar text is not UTF-8: {exc}") from None
        compiled = GuidanceCompiledGrammar(grammar, self, spec.kind)
        compiled.prepare()  # here, on a loader thread, rather than when a request starts
        return compiled

    # ------------------------------------------------------------------ masks
    def _check_rows(self, bitmask: torch.Tensor) -> None:
        """Raises ValueError unless ``bitmask`` is ``[rows, words]``, int32, contiguous on the
        CPU; notes its first row's address, row size and rows (``_row_ptr``). Each step's
        fill passes the same view of a buffer: it is looked at once (a tensor's shape and
        storage stay)."""
        if bitmask is self._checked:
            return
        if bitmask.dim() != 2 or bitmask.shape[1] != bitmask_width(self.vocab_size):
            raise ValueError(
                f"bitmask must be [rows, {bitmask_width(self.vocab_size)}], "
                f"got {list(bitmask.shape)}"
            )
        _check_layout(bitmask)  # llguidance writes through raw pointers
        row_bytes = bitmask.stride(0) * bitmask.element_size()
        self._row_ptr = (bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        self._checked = bitmask

    def plan_fill(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        off_thread: bool = False,
    ) -> NativeFill:
        """Few rows are filled now, one by one; many go to llguidance's executor, which
        fills them in parallel without the GIL, in the returned call. ``off_thread``: every
        row goes to an executor of one thread.

        Raises:
            ValueError: ``bitmask`` is not ``[rows, words]`` int32 contiguous on the CPU.
        """
        self._check_rows(bitmask)
        live: list[tuple[llguidance.LLMatcher, int]] = []
        for matcher, row in zip(matchers, rows, strict=True):
            if not isinstance(matcher, GuidanceMatcher) or matcher.is_terminated():
                matcher.fill_bitmask(bitmask, row)
            else:
                live.append((matcher.ll, row))
        if off_thread:
            # One fill thread: the engine thread's Python runs on the other core meanwhile.
            threads, here = 1, len(live) < 2
        else:
            threads = self._fill_threads
            here = threads == 1 or len(live) < self._parallel_min_rows
        if here:
            base, row_bytes, num_rows = self._row_ptr
            for ll, row in live:
                if not 0 <= row < num_rows:
                    raise IndexError(f"bitmask row {row} is outside [0, {num_rows})")
                # The row's address, not a view of it (a torch call per row): the layout
                # is checked, contiguous rows of row_bytes each.
                ll.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
            return filled_now
        with self._lock:
            executor = self._executors.get(threads)
            if executor is None:
                executor = self._executors[threads] = llguidance.LLExecutor(num_threads=threads)
        return functools.partial(_fill_rows, executor, live, bitmask)
