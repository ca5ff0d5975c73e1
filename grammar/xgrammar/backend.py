"""The xgrammar structured-output backend: every spec kind, batched bitmask fills.

The table of JSON-schema keywords xgrammar enforces, and the walk that finds the ones it
would ignore (``unsupported_reason`` refuses those, or lets "auto" pass the spec on), are in
``grammar/xgrammar/keywords.py``.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

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
from baton.grammar.schema.normalise import close_object_schemas
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.structural_tag import (
    json_schema_formats,
    map_json_schema_formats,
    normalise_structural_tag,
)
from baton.grammar.validation import ebnf_grammar_error
from baton.grammar.vocab import Vocab, VocabSource, build_vocab
from baton.grammar.xgrammar.keywords import (
    XGRAMMAR_ENFORCED_FORMATS,
    XGRAMMAR_ENFORCED_KEYWORDS,
    XGRAMMAR_UNENFORCED_FORMATS,
    XGRAMMAR_UNENFORCED_KEYWORDS,
    xgrammar_unenforced_keywords,
)
from baton.grammar.xgrammar.normal_form import (
    open_objects_refusal,
    xgrammar_policy_form,
)
from baton.grammar.xgrammar.patterns import ebnf_string_literal
from baton.grammar.xgrammar.rewrites import rewrite_json_ebnf, unshare_root

# A structural tag's JSON-schema content with only these keys is compiled as a json spec.
_PLAIN_JSON_FORMAT_KEYS = frozenset(
    {"type", "json_schema", "style", "any_order", "excludes", "max_whitespace_cnt"}
)
# xgrammar compiles such a format's schema itself, in strict mode: closed objects only.
_OPEN_OWN_OPTIONS = (
    "xgrammar cannot honour open_objects in a structural tag's JSON format with its own "
    "options (style, any_order, excludes, max_whitespace_cnt): it compiles those closed"
)


def _own_options(fmt: dict[str, Any]) -> bool:
    """Whether a structural tag's JSON-schema format has options that xgrammar reads itself
    (then it compiles the format, not baton)."""
    return bool(
        fmt.get("style", "json") != "json"
        or fmt.get("any_order")
        or fmt.get("excludes")
        or fmt.get("max_whitespace_cnt") is not None
        or set(fmt) - _PLAIN_JSON_FORMAT_KEYS
    )


# ---------------------------------------------------------------------------- helpers


def _rewritten(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (xgrammar's grammar of a JSON schema) with baton's rewrites of its EBNF:
    length-bounded strings closed to raw control characters, string escapes and counted
    patterns in shapes whose masks xgrammar can precompute (``grammar/xgrammar/rewrites.py``
    says which and why); ``grammar`` itself when none applies."""
    text = str(grammar)
    fixed = rewrite_json_ebnf(text)
    if fixed == text:
        return grammar
    return xgr.Grammar.from_ebnf(fixed, root_rule_name="root")


def _ebnf_grammar(text: str) -> xgr.Grammar:
    """A user's EBNF grammar, its root rule wrapped where the grammar refers to it (rewrite 5
    of ``grammar/xgrammar/rewrites.py``: xgrammar's masks refuse a token that runs past a nested
    root's end, which its matcher accepts)."""
    grammar = xgr.Grammar.from_ebnf(text, root_rule_name="root")
    printed = str(grammar)
    fixed = unshare_root(printed)
    if fixed == printed:
        return grammar
    return xgr.Grammar.from_ebnf(fixed, root_rule_name="root")


CONTROL_PREFIX = b"\xff"
"""What a control token's text follows in xgrammar's vocabulary (never a byte of UTF-8 text)."""

_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its timestamp/source prefix."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _XGR_LOG_PREFIX.sub("", text)


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in dict.fromkeys(choices))


# ---------------------------------------------------------------------------- matcher


class XGrammarCompiledGrammar(CompiledGrammar):
    """An ``xgr.CompiledGrammar`` plus what its matchers need from the backend."""

    backend_name = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend, kind: str) -> None:
        self.compiled = compiled
        self.kind = kind
        self._backend = backend

    @property
    def memory_size_bytes(self) -> int:
        """Approximate memory held by the compiled grammar (for cache sizing)."""
        return int(self.compiled.memory_size_bytes)

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self._backend)


class XGrammarMatcher(GrammarMatcher):
    """One request's position in an xgrammar grammar.

    Token ids outside the model vocabulary and anything after termination are rejected
    here, before xgrammar (which would log a warning); a control token is xgrammar's to
    reject unless the grammar names it (``CONTROL_PREFIX``).
    A terminated matcher's bitmask row allows only the EOS ids. Rollback depth
    is unlimited (xgrammar 0.2 keeps the whole history).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._backend = backend
        # Mirrors xgrammar's is_terminated(), which only accepting a stop token can change: a
        # structured request's token then costs one call into xgrammar instead of three.
        self._terminated = False

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped ``xgr.GrammarMatcher``."""
        return self._m

    def _accept(self, token: int) -> bool:
        backend = self._backend
        if self._terminated or backend.never_allowed(token):
            return False
        if not self._m.accept_token(int(token)):
            return False
        if token in backend.eos_token_ids:
            self._terminated = bool(self._m.is_terminated())
        return True

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advances by all ``tokens``, or (when one is rejected) by none of them."""
        if len(tokens) == 1:  # each step's token: nothing to roll back
            return self._accept(tokens[0])
        for i, token in enumerate(tokens):
            if not self._accept(token):
                if i:
                    self._rollback(i)
                return False
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        n = 0
        for token in tokens:
            if not self._accept(token):
                break
            n += 1
        if n:
            self._rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens.

        Raises:
            ValueError: ``num_tokens`` is negative or more than were accepted.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return
        try:
            self._rollback(num_tokens)
        except RuntimeError as exc:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {_reason(exc)}") from None

    def _rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        self._terminated = bool(self._m.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes this matcher's allowed tokens into ``bitmask[row]``.

        Raises:
            ValueError: ``bitmask`` is not a CPU int32 ``[rows, ceil(vocab/32)]`` tensor.
        """
        self._backend.check_bitmask(bitmask)
        if self._terminated:
            bitmask[row].copy_(self._backend.eos_row)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._m.reset()
        self._terminated = False

    def jump_forward_string(self) -> str:
        if self._terminated:
            return ""
        return str(self._m.find_jump_forward_string())


# ---------------------------------------------------------------------------- backend


class XGrammarBackend(GrammarBackend):
    """Compiles every spec kind with xgrammar for one tokenizer and model vocabulary.

    Args:
        tokenizer: baton's ``Tokenizer`` (anything ``build_vocab`` reads).
        vocab_size: the model's vocabulary size (the bitmask width is
            ceil(vocab_size / 32)); ids past the tokenizer's vocabulary are never allowed.
        max_threads: threads of xgrammar's compiler and of large batched mask fills.
        parallel_fill_min_rows: batches with fewer live rows are filled by one thread (a
            row takes ~5-10 us; on a busy 2-core host a 2-thread fill of 16-256 rows was
            2-10x slower than a 1-thread one, so threads pay only for large batches).
        dynamic_compilation: build token-mask caches lazily, at first use,
            instead of at compile time: compiles become near-instant (a large
            schema can take tens of seconds eagerly) and the first fills of
            each grammar state pay instead.

    The compiler's own cache is off: baton's compile service caches. One
    ``xgr.GrammarCompiler`` serves concurrent ``compile`` calls (it is built
    for multi-threaded use and releases the GIL).

    Raises:
        ValueError: vocab_size, max_threads or parallel_fill_min_rows < 1, or an EOS id
            outside the vocabulary.
    """

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: VocabSource,
        vocab_size: int,
        *,
        max_threads: int = 2,
        dynamic_compilation: bool = False,
        parallel_fill_min_rows: int = 128,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if parallel_fill_min_rows < 1:
            raise ValueError(f"parallel_fill_min_rows must be >= 1, got {parallel_fill_min_rows}")
        vocab = build_vocab(tokenizer)
        eos = list(vocab.eos_token_ids)
        if not eos or any(not 0 <= e < vocab_size for e in eos):
            raise ValueError(f"EOS ids {eos} must lie in [0, vocab_size={vocab_size})")
        self.vocab: Vocab = vocab
        self.vocab_key: str = f"{vocab.key}:{vocab_size}"
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        # A control token is its text after a 0xFF byte, which no UTF-8 text holds: no string,
        # regex or schema can spell it, only a structural tag's token format names it (a tool
        # call's marker, harmony's channels). The stop ids are allowed where the grammar may end.
        encoded = [
            CONTROL_PREFIX + tok if i in vocab.special_ids else tok
            for i, tok in enumerate(vocab.token_bytes[:vocab_size])
        ]
        # build_vocab already decoded byte-level / byte-fallback pieces to raw bytes, so RAW.
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(eos)
        )
        self._never = frozenset(range(len(encoded), vocab_size))
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=max_threads,
            cache_enabled=False,
            enable_dynamic_compilation=dynamic_compilation,
        )
        self._serial_batch = xgr.BatchGrammarMatcher(1)
        self._parallel_batch = (
            xgr.BatchGrammarMatcher(max_threads) if max_threads > 1 else self._serial_batch
        )
        self._parallel_min_rows = parallel_fill_min_rows
        self._batch_lock = threading.Lock()
        self.eos_row = token_bitmask_row(eos, vocab_size)
        # The last bitmask ``check_bitmask`` passed (a tensor's dtype, device and shape stay).
        self._checked: torch.Tensor | None = None

    def never_allowed(self, token: int) -> bool:
        """True for ids no grammar may produce: out of range, padding ids (a control token only
        where a structural tag's token format names it: xgrammar's masks decide)."""
        return not 0 <= token < self.vocab_size or token in self._never

    def check_bitmask(self, bitmask: torch.Tensor) -> None:
        """Raises ValueError unless ``bitmask`` is a CPU int32 [rows, width] tensor."""
        if bitmask is self._checked:  # each step's fill passes the same view: checked once
            return
        width = bitmask_width(self.vocab_size)
        if (
            bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu"
            or bitmask.dim() != 2
            or bitmask.shape[1] != width
        ):
            raise ValueError(
                f"bitmask must be a CPU int32 tensor of shape [rows, {width}], got "
                f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        self._checked = bitmask

    # ------------------------------------------------------------------ specs

    def unsupported_reason(self, spec: StructuredOutputsParams) -> str | None:
        """None for every spec kind, except a grammar that is not EBNF (such as Lark, which
        llguidance reads), and a JSON schema (or a structural tag holding one) with keywords
        xgrammar would not enforce (unless ``spec.allow_unenforced``): then why."""
        if spec.kind == "grammar":
            error = ebnf_grammar_error(spec.grammar or "")
            return None if error is None else f"xgrammar reads EBNF grammars only: {error}"
        if spec.kind not in ("json", "structural_tag"):
            return None
        try:
            if spec.kind == "json":
                schemas = [spec.schema]
            else:
                formats = json_schema_formats(normalise_structural_tag(spec.structural_tag or {}))
                if spec.open_objects and any(_own_options(f) for f in formats):
                    return _OPEN_OWN_OPTIONS
                schemas = [f["json_schema"] for f in formats]
        except ValueError:
            return None  # compile() reports the bad spec text
        for schema in schemas:
            refused = open_objects_refusal(schema) if spec.open_objects else None
            if refused is not None:
                return refused
        if spec.allow_unenforced:
            return None
        unenforced: set[str] = set()
        for schema in schemas:
            unenforced |= xgrammar_unenforced_keywords(
                xgrammar_policy_form(schema, spec.open_objects)
            )
        if not unenforced:
            return None
        where = "" if spec.kind == "json" else " (in the structural tag's JSON schemas)"
        return (
            f"xgrammar does not enforce these JSON-schema keywords{where}: "
            + ", ".join(sorted(unenforced))
            + " (set allow_unenforced to accept the schema with them ignored)"
        )

    def compile(self, spec: StructuredOutputsParams) -> XGrammarCompiledGrammar:
        """Compiles ``spec`` (any kind); thread-safe.

        Raises:
            GrammarError: the spec is malformed or uses something xgrammar cannot compile;
                the message names the kind and xgrammar's reason.
        """
        kind = spec.kind
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise GrammarError(f"xgrammar cannot compile the {kind} spec: {_reason(exc)}") from exc
        return XGrammarCompiledGrammar(compiled, self, kind)

    def export_compiled(self, compiled: CompiledGrammar) -> bytes:
        """The compiled grammar as xgrammar's EBNF text, after xgrammar's own rewriting.

        Not ``xgr.CompiledGrammar.serialize_json``: that writes every token mask (and first
        computes them all under dynamic compilation); measured on SchemaStore schemas it took
        10-1000x the compile time and wrote up to hundreds of MB. The text is kilobytes and
        compiles again in milliseconds (``import_compiled``).

        Raises:
            TypeError: ``compiled`` is not an ``XGrammarCompiledGrammar``.
        """
        if not isinstance(compiled, XGrammarCompiledGrammar):
            raise TypeError(f"expected an XGrammarCompiledGrammar, got {type(compiled).__name__}")
        return str(compiled.compiled.grammar).encode("utf-8", "surrogatepass")

    def import_compiled(
        self, spec: StructuredOutputsParams, data: bytes
    ) -> XGrammarCompiledGrammar:
        """Compiles the grammar text that ``export_compiled`` wrote for ``spec``.

        Should xgrammar fail to read its own text back, ``spec`` is compiled here instead: a
        compile worker has just compiled it within the time limit, so this is bounded too.

        Raises:
            GrammarError: as ``compile``.
        """
        try:
            grammar = xgr.Grammar.from_ebnf(
                data.decode("utf-8", "surrogatepass"), root_rule_name="root"
            )
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError, UnicodeDecodeError):
            return self.compile(spec)
        return XGrammarCompiledGrammar(compiled, self, spec.kind)

    def _json_options(self, spec: StructuredOutputsParams) -> dict[str, Any]:
        if spec.whitespace == "any":
            return {"any_whitespace": True, "max_whitespace_cnt": spec.max_whitespace_cnt}
        return {"any_whitespace": False, "separators": (",", ":")}

    def _json_grammar(self, schema: Any, spec: StructuredOutputsParams) -> xgr.Grammar:
        """The grammar of a JSON schema as baton compiles it: strict mode, the spec's
        whitespace and object policy (``xgrammar_policy_form``), and baton's rewrites of
        xgrammar's EBNF (see ``_rewritten``).

        Raises:
            GrammarError: open objects asked for where xgrammar cannot write them exactly.
        """
        refused = open_objects_refusal(schema) if spec.open_objects else None
        if refused is not None:
            raise GrammarError(refused)
        schema = xgrammar_policy_form(schema, spec.open_objects)
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), strict_mode=True, **self._json_options(spec)
        )
        return _rewritten(grammar)

    def _structural_tag_text(self, spec: StructuredOutputsParams) -> str:
        """The spec's structural tag as xgrammar's JSON text, its plain JSON-schema contents
        (style "json", no ``any_order`` or ``excludes``) replaced by the grammar baton compiles
        for a ``json`` spec. xgrammar's own reading of such a content differs: unbounded free
        whitespace and raw control characters in length-bounded strings."""
        tag = normalise_structural_tag(spec.structural_tag or {})

        def as_grammar(fmt: dict[str, Any]) -> dict[str, Any]:
            if _own_options(fmt):
                if spec.open_objects:
                    raise GrammarError(_OPEN_OWN_OPTIONS)
                return fmt
            return {"type": "grammar", "grammar": str(self._json_grammar(fmt["json_schema"], spec))}

        return json.dumps(map_json_schema_formats(tag, as_grammar))

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        c = self._compiler
        if kind == "json":
            return c.compile_grammar(self._json_grammar(spec.schema, spec))
        if kind == "json_object":
            # Non-strict: an object schema without properties then admits any keys and values.
            grammar = xgr.Grammar.from_json_schema(
                '{"type": "object"}', strict_mode=False, **self._json_options(spec)
            )
            return c.compile_grammar(_rewritten(grammar))
        if kind == "regex":
            return c.compile_regex(spec.regex or "")
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(spec.choice or ()))
        if kind == "grammar":
            return c.compile_grammar(_ebnf_grammar(spec.grammar or ""))
        if kind == "structural_tag":
            return c.compile_structural_tag(self._structural_tag_text(spec))
        raise ValueError(f"unknown spec kind {kind!r}")

    # ------------------------------------------------------------------ masks

    def plan_fill(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        off_thread: bool = False,
    ) -> NativeFill:
        """Writes the rows of terminated matchers now and returns one native batched fill
        of the others (it releases the GIL; on one thread when ``off_thread``).

        Raises:
            TypeError: a matcher is not an ``XGrammarMatcher``.
            ValueError: ``bitmask`` has the wrong dtype, device or width, or the lengths differ.
        """
        if len(matchers) != len(rows):
            raise ValueError(f"{len(matchers)} matchers but {len(rows)} rows")
        self.check_bitmask(bitmask)
        for matcher in matchers:
            if not isinstance(matcher, XGrammarMatcher):
                raise TypeError(f"expected an XGrammarMatcher, got {type(matcher).__name__}")
        # The native batch call refuses terminated matchers: their rows allow the EOS ids.
        # Comprehensions over the batch, not a loop of appends: this runs every step.
        done = [i for i, matcher in enumerate(matchers) if matcher.is_terminated()]
        for i in done:
            bitmask[rows[i]].copy_(self.eos_row)
        if done:
            skip = set(done)
            kept = [i for i in range(len(matchers)) if i not in skip]
            live = [matchers[i].xgr_matcher for i in kept]
            live_rows = [int(rows[i]) for i in kept]
        else:
            live = [matcher.xgr_matcher for matcher in matchers]
            live_rows = [int(row) for row in rows]
        if not live:
            return filled_now
        if len(live) == 1:  # the batch API's list handling costs more than it saves here
            return functools.partial(live[0].fill_next_token_bitmask, bitmask, live_rows[0])
        # Off the engine thread one fill thread leaves the other core to the engine's Python
        # (measured: two threads beside it made the fill slower than one).
        parallel = not off_thread and len(live) >= self._parallel_min_rows
        batch = self._parallel_batch if parallel else self._serial_batch

        def fill() -> None:
            with self._batch_lock:
                batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)

        return fill


def bitmask_allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids allowed by ``bitmask[row]`` (a debugging and test helper)."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    ids = torch.nonzero(bits.reshape(-1)[:vocab_size]).flatten()
    return ids.tolist()


__all__ = [
    "XGRAMMAR_ENFORCED_FORMATS",
    "XGRAMMAR_ENFORCED_KEYWORDS",
    "XGRAMMAR_UNENFORCED_FORMATS",
    "XGRAMMAR_UNENFORCED_KEYWORDS",
    "XGrammarBackend",
    "XGrammarCompiledGrammar",
    "XGrammarMatcher",
    "bitmask_allowed",
    "choice_ebnf",
    "close_object_schemas",
    "ebnf_string_literal",
    "xgrammar_unenforced_keywords",
]
