"""The xgrammar structured-output backend: every spec kind, batched bitmask fills.

Besides the backend, this module holds the table of JSON-schema keywords that
xgrammar enforces and the ones it silently ignores (measured with xgrammar
0.2.9; ``tests/test_grammar_xgrammar.py`` shows each entry with an instance),
and ``xgrammar_unenforced_keywords``, which finds the ignored ones in a schema
so that ``unsupported_reason`` can refuse it (or let "auto" fall back).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import xgrammar as xgr

from baton.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    bitmask_width,
    token_bitmask_row,
)
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.structural_tag import (
    json_schema_formats,
    map_json_schema_formats,
    normalise_structural_tag,
)
from baton.grammar.vocab import Vocab, VocabSource, build_vocab
from baton.grammar.xgrammar_rewrites import rewrite_json_ebnf

# ---------------------------------------------------------------------------- enforcement table
# Measured by compiling schemas with strict_mode=True (what the backend uses) and walking valid
# and invalid instances through a matcher. "Enforced" means an invalid instance is rejected; some
# enforced keywords are stricter than JSON Schema (noted), which only ever rejects valid output.

XGRAMMAR_ENFORCED_KEYWORDS: Mapping[str, str] = {
    "type": "all seven types and type lists",
    "enum": "exact values; wins over sibling keywords (see xgrammar_unenforced_keywords)",
    "const": "exact value; wins over enum and other siblings",
    "properties": "in the schema's declared order only; implies type object when type is absent",
    "required": "for declared properties only",
    "additionalProperties": "false or a schema; with strict mode an object that declares "
    "properties allows no other keys unless additionalProperties says so",
    "unevaluatedProperties": "false is what strict mode does anyway",
    "minProperties": "with properties or additionalProperties (or type object)",
    "maxProperties": "with properties or additionalProperties (or type object)",
    "propertyNames": "checked on additional keys, not on declared property names",
    "patternProperties": "keys must match a pattern in full (anchored), values its schema; "
    "not beside properties plus a non-false additionalProperties (then ignored); a key that "
    "JSON Schema matches by search against another pattern escapes that pattern's schema",
    "items": "a schema or false (an array of schemas, draft 4 tuples, fails to compile)",
    "prefixItems": "positional schemas; with strict mode no further items unless items allows",
    "unevaluatedItems": "false is what strict mode does anyway",
    "minItems": "with items or prefixItems (or type array)",
    "maxItems": "with items or prefixItems (or type array)",
    "minLength": "unless beside pattern or format (then ignored); such a string holds plain "
    "characters only, no escape sequence (stricter than JSON Schema)",
    "maxLength": "unless beside pattern or format (then ignored); such a string holds plain "
    "characters only, no escape sequence (stricter than JSON Schema)",
    "pattern": "anchored: an unanchored pattern must match the whole string; "
    "lookarounds are ignored; one that counts a repetition past 128 holds plain characters "
    "only, no escape sequence (stricter than JSON Schema)",
    "format": "the formats in XGRAMMAR_ENFORCED_FORMATS, syntax only (no calendar checks)",
    "minimum": "integer and number",
    "maximum": "integer and number",
    "exclusiveMinimum": "numeric form (the draft 4 boolean form fails to compile)",
    "exclusiveMaximum": "numeric form (the draft 4 boolean form fails to compile)",
    "multipleOf": "integer type with an integer divisor only",
    "anyOf": "alternatives; sibling keywords are ignored",
    "oneOf": "treated as anyOf: an instance matching several branches is accepted",
    "allOf": "a single subschema only; sibling keywords are ignored",
    "$ref": "local JSON pointers ('#', '#/...'), recursion included; sibling keywords are ignored",
}

XGRAMMAR_UNENFORCED_KEYWORDS: Mapping[str, str] = {
    "not": "ignored",
    "if": "if/then/else ignored",
    "dependentRequired": "ignored",
    "dependentSchemas": "ignored",
    "dependencies": "ignored",
    "uniqueItems": "ignored (duplicates accepted)",
    "contains": "ignored (minContains/maxContains with it)",
    "$dynamicRef": "resolves to any value",
    "$recursiveRef": "resolves to any value",
}

# JSON Schema's defined string formats, split by whether xgrammar checks them.
XGRAMMAR_ENFORCED_FORMATS: frozenset[str] = frozenset(
    {
        "date",
        "date-time",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)
XGRAMMAR_UNENFORCED_FORMATS: frozenset[str] = frozenset(
    {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
)

# Keywords that only act through another one (if, contains), reported under that one.
_DEPENDENT = frozenset({"then", "else", "minContains", "maxContains"})
_VALIDATING = (
    frozenset(XGRAMMAR_ENFORCED_KEYWORDS)
    | frozenset(XGRAMMAR_UNENFORCED_KEYWORDS)
    | _DEPENDENT
    | {"additionalItems"}
)
# Anything else (title, description, default, $defs, $id, x-..., unknown words) is an annotation.
# When a schema holds several of these, xgrammar builds it from the first alone.
_DOMINANT_ORDER = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")

_TYPE_KEYWORDS: dict[str, tuple[str, ...]] = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("minItems", "maxItems"),
    "object": ("required", "minProperties", "maxProperties", "propertyNames", "patternProperties"),
}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _types_of(node: Mapping[str, Any]) -> set[str] | None:
    """The types xgrammar builds ``node`` for; None when it accepts any value."""
    t = node.get("type")
    if isinstance(t, str):
        types = {t}
    elif isinstance(t, list):
        types = {x for x in t if isinstance(x, str)}
    elif "properties" in node or "additionalProperties" in node:
        types = {"object"}
    elif "items" in node or "prefixItems" in node:
        types = {"array"}
    else:
        return None
    if "integer" in types:
        types.add("number")
    return types


def _raw_types(t: Any) -> set[str]:
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _within(inner: set[str], outer: set[str]) -> bool:
    """Whether every instance of types ``inner`` is of types ``outer``."""
    return all(t in outer or (t == "integer" and "number" in outer) for t in inner)


def _possible_types(node: Any, root: Any, depth: int) -> set[str] | None:
    """The JSON types xgrammar's grammar for ``node`` can produce; None when any or unknown."""
    if not isinstance(node, dict) or depth > 32:
        return None
    if "$ref" in node:
        ref = node["$ref"]
        if not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return None
        return _possible_types(_resolve_pointer(root, ref), root, depth + 1)
    if "const" in node:
        return {_value_type(node["const"])}
    if "enum" in node:
        values = node["enum"]
        return {_value_type(v) for v in values} if isinstance(values, list) else None
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node:
            branches = node[key]
            if not isinstance(branches, list) or (key == "allOf" and len(branches) != 1):
                return None
            out: set[str] = set()
            for branch in branches:
                types = _possible_types(branch, root, depth + 1)
                if types is None:
                    return None
                out |= types
            return out
    types = _types_of(node)
    if types is None:
        return None
    return _raw_types(node["type"]) if "type" in node else types


def oneof_branches_disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no instance can match two ``oneOf`` branches, provably and cheaply.

    Backends build ``oneOf`` as an alternation (``anyOf``): exclusivity is
    enforced only when the branches cannot overlap. Proven here when their
    JSON types are pairwise disjoint, or when every branch is a ``const`` or
    ``enum`` and no value repeats.
    """
    type_sets = [_possible_types(b, root, 0) for b in branches]
    if all(t is not None for t in type_sets):
        seen: set[str] = set()
        disjoint = True
        for types in type_sets:
            norm = {"number" if t == "integer" else t for t in types}  # type: ignore[union-attr]
            if norm & seen:
                disjoint = False
                break
            seen |= norm
        if disjoint:
            return True
    values: set[str] = set()
    for branch in branches:
        if not isinstance(branch, dict) or not ({"const", "enum"} & set(branch)):
            return False
        options = [branch["const"]] if "const" in branch else branch["enum"]
        if not isinstance(options, list):
            return False
        for v in options:
            key = json.dumps(v, sort_keys=True)
            if key in values:
                return False
            values.add(key)
    return True


def _json_type_ok(value: Any, types: set[str]) -> bool:
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if isinstance(value, str):
        return "string" in types
    if value is None:
        return "null" in types
    if isinstance(value, list):
        return "array" in types
    return isinstance(value, dict) and "object" in types


def _values_satisfy(values: list[Any], siblings: dict[str, Any], root: Any) -> bool:
    """Whether every enum/const value is valid under the sibling keywords xgrammar drops."""
    if set(siblings) == {"type"}:
        types = _types_of(siblings)
        return types is not None and all(_json_type_ok(v, types) for v in values)
    try:
        import jsonschema  # a dev dependency: without it, be conservative
    except ImportError:
        return False
    sub: dict[str, Any] = dict(siblings)
    if isinstance(root, dict):
        for defs in ("$defs", "definitions"):
            if defs in root:
                sub[defs] = root[defs]
    try:
        validator = jsonschema.Draft202012Validator(sub)
        return all(validator.is_valid(v) for v in values)
    except Exception:  # noqa: BLE001 - an unresolvable sibling: assume the worst
        return False


def _resolve_pointer(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _subschemas(node: Mapping[str, Any]) -> Iterator[Any]:
    """The subschemas of a schema without a dominant keyword that xgrammar builds."""
    if isinstance(node.get("properties"), dict):
        yield from node["properties"].values()
    for key in ("additionalProperties", "unevaluatedProperties", "items"):
        if isinstance(node.get(key), dict):
            yield node[key]
    names = node.get("propertyNames")
    if isinstance(names, dict):
        # Property names are strings: xgrammar applies string keywords without a type here.
        yield names if "type" in names else {"type": "string", **names}
    if isinstance(node.get("patternProperties"), dict):
        yield from node["patternProperties"].values()
    if isinstance(node.get("prefixItems"), list):
        yield from node["prefixItems"]


def xgrammar_unenforced_keywords(schema: Any) -> set[str]:
    """The keywords of a JSON schema that xgrammar would not enforce.

    Walks the schema from its root, following local ``$ref``s (unreferenced
    ``$defs`` do not count), and reports, each as a short label:
    keywords of ``XGRAMMAR_UNENFORCED_KEYWORDS`` (e.g. ``"not"``); string
    formats xgrammar does not check (``"format (iri)"``); keywords dropped
    because a sibling wins (``"minimum (beside $ref)"``, ``"type (beside
    anyOf)"``, an ``enum`` sibling only when an enum value violates it);
    ``"allOf (several subschemas)"``; type-specific keywords in a schema
    without a type (``"minimum (no type)"``); ``"multipleOf (number)"``;
    ``"minLength (beside pattern/format)"``, ``"pattern (beside format)"``,
    ``"pattern (lookaround)"``; ``"patternProperties (lookaround)"``,
    ``"patternProperties (beside additionalProperties)"``; ``"required
    (undeclared property)"``; ``"propertyNames (declared properties)"``;
    ``"$ref (non-local)"``; ``"oneOf (overlapping branches)"`` when the
    branches are not provably disjoint (xgrammar builds ``oneOf`` as ``anyOf``).

    Unknown keywords are annotations under JSON Schema and are not reported.
    Never raises on odd input: parts that are not schemas are skipped.
    """
    found: set[str] = set()
    seen: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        _check_node(node, schema, found, stack)
    return found


def _check_node(node: dict[str, Any], root: Any, found: set[str], stack: list[Any]) -> None:
    keys = set(node)
    for kw in keys & set(XGRAMMAR_UNENFORCED_KEYWORDS):
        if kw == "uniqueItems" and node[kw] is not True:
            continue
        found.add(kw)
    dominant = next((k for k in _DOMINANT_ORDER if k in keys), None)
    siblings = {
        k: node[k]
        for k in keys
        if k in _VALIDATING
        and k != dominant
        and k not in XGRAMMAR_UNENFORCED_KEYWORDS
        and k not in _DEPENDENT
    }
    if dominant is not None:
        if dominant in ("const", "enum"):
            values = [node["const"]] if dominant == "const" else node.get("enum")
            if siblings and not (
                isinstance(values, list) and _values_satisfy(values, siblings, root)
            ):
                found.update(f"{k} (beside {dominant})" for k in siblings)
            return
        if "type" in siblings:
            # A dropped type costs nothing when the dominant keyword only yields those types.
            only = _possible_types({dominant: node[dominant]}, root, 0)
            if only is not None and _within(only, _raw_types(siblings["type"])):
                del siblings["type"]
        found.update(f"{k} (beside {dominant})" for k in siblings)
        if dominant == "$ref":
            ref = node["$ref"]
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                stack.append(_resolve_pointer(root, ref))
            else:
                found.add("$ref (non-local)")
        elif isinstance(node[dominant], list):
            if dominant == "allOf" and len(node["allOf"]) > 1:
                found.add("allOf (several subschemas)")
            else:
                if dominant == "oneOf" and not oneof_branches_disjoint(node["oneOf"], root):
                    found.add("oneOf (overlapping branches)")
                stack.extend(node[dominant])
        return
    types = _types_of(node)
    if types is None:
        for kws in _TYPE_KEYWORDS.values():
            for kw in kws:
                if kw in keys and not (
                    kw == "format" and node[kw] not in XGRAMMAR_ENFORCED_FORMATS
                ):
                    found.add(f"{kw} (no type)")
    else:
        _check_typed(node, types, found)
    stack.extend(_subschemas(node))


def _check_typed(node: dict[str, Any], types: set[str], found: set[str]) -> None:
    if "multipleOf" in node:
        divisor = node["multipleOf"]
        integral = isinstance(divisor, int) or (isinstance(divisor, float) and divisor.is_integer())
        if "number" in types and ("integer" not in types or not integral):
            found.add("multipleOf (number)")
    if "string" in types:
        fmt = node.get("format")
        pattern = node.get("pattern")
        if fmt in XGRAMMAR_UNENFORCED_FORMATS:
            found.add(f"format ({fmt})")
        checked_format = fmt in XGRAMMAR_ENFORCED_FORMATS
        if checked_format and pattern is not None:
            found.add("pattern (beside format)")
        if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
            found.add("pattern (lookaround)")
        if checked_format or pattern is not None:
            found.update(
                f"{kw} (beside pattern/format)" for kw in ("minLength", "maxLength") if kw in node
            )
    if "object" in types:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required")
        if isinstance(required, list) and any(r not in props for r in required):
            found.add("required (undeclared property)")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and any(_LOOKAROUND.search(p) for p in patterns):
            found.add("patternProperties (lookaround)")
        extra = node.get("additionalProperties", False)
        if props and "patternProperties" in node and extra is not False:
            found.add("patternProperties (beside additionalProperties)")
        names = node.get("propertyNames")
        if props and isinstance(names, dict) and not _values_satisfy(list(props), names, None):
            found.add("propertyNames (declared properties)")


def close_object_schemas(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) gets ``additionalProperties: false``."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        t = node.get("type")
        is_object = t == "object" or (isinstance(t, list) and "object" in t)
        if (is_object or (t is None and "properties" in node)) and not (
            "additionalProperties" in node or "unevaluatedProperties" in node
        ):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in (
                "properties",
                "patternProperties",
                "$defs",
                "definitions",
                "dependentSchemas",
            ):
                if isinstance(value, dict):
                    stack.extend(value.values())
            elif key in ("enum", "const", "default", "examples", "required"):
                continue
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return schema


# A structural tag's JSON-schema content with only these keys is compiled as a json spec.
_PLAIN_JSON_FORMAT_KEYS = frozenset(
    {"type", "json_schema", "style", "any_order", "excludes", "max_whitespace_cnt"}
)


# ---------------------------------------------------------------------------- helpers


def _rewritten(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (xgrammar's grammar of a JSON schema) with baton's rewrites of its EBNF:
    length-bounded strings closed to raw control characters, string escapes and counted
    patterns in shapes whose masks xgrammar can precompute (``grammar/xgrammar_rewrites.py``
    says which and why); ``grammar`` itself when none applies."""
    text = str(grammar)
    fixed = rewrite_json_ebnf(text)
    if fixed == text:
        return grammar
    return xgr.Grammar.from_ebnf(fixed, root_rule_name="root")


_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its timestamp/source prefix."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _XGR_LOG_PREFIX.sub("", text)


def ebnf_string_literal(text: str) -> str:
    """``text`` as a quoted EBNF string literal that matches exactly it."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


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

    Token ids outside the model vocabulary, control tokens and anything after
    termination are rejected here, before xgrammar (which would log a warning).
    A terminated matcher's bitmask row allows only the EOS ids. Rollback depth
    is unlimited (xgrammar 0.2 keeps the whole history).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self._backend = backend

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped ``xgr.GrammarMatcher``."""
        return self._m

    def _accept(self, token: int) -> bool:
        if self._backend.never_allowed(token) or self._m.is_terminated():
            return False
        return bool(self._m.accept_token(int(token)))

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advances by all ``tokens``, or (when one is rejected) by none of them."""
        for i, token in enumerate(tokens):
            if not self._accept(token):
                if i:
                    self._m.rollback(i)
                return False
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        n = 0
        for token in tokens:
            if not self._accept(token):
                break
            n += 1
        if n:
            self._m.rollback(n)
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
            self._m.rollback(num_tokens)
        except RuntimeError as exc:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {_reason(exc)}") from None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes this matcher's allowed tokens into ``bitmask[row]``.

        Raises:
            ValueError: ``bitmask`` is not a CPU int32 ``[rows, ceil(vocab/32)]`` tensor.
        """
        self._backend.check_bitmask(bitmask)
        if self._m.is_terminated():
            bitmask[row].copy_(self._backend.eos_row)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def reset(self) -> None:
        self._m.reset()

    def jump_forward_string(self) -> str:
        if self._m.is_terminated():
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
        # Empty tokens are xgrammar's "special" tokens: never allowed inside a grammar; the stop
        # ids are then allowed exactly where the grammar may end.
        encoded = [
            b"" if i in vocab.special_ids else tok
            for i, tok in enumerate(vocab.token_bytes[:vocab_size])
        ]
        # build_vocab already decoded byte-level / byte-fallback pieces to raw bytes, so RAW.
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(eos)
        )
        self._never = frozenset(vocab.special_ids - set(eos)) | frozenset(
            range(len(encoded), vocab_size)
        )
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

    def never_allowed(self, token: int) -> bool:
        """True for ids no grammar may produce: out of range, control tokens, padding ids."""
        return not 0 <= token < self.vocab_size or token in self._never

    def check_bitmask(self, bitmask: torch.Tensor) -> None:
        """Raises ValueError unless ``bitmask`` is a CPU int32 [rows, width] tensor."""
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

    # ------------------------------------------------------------------ specs

    def unsupported_reason(self, spec: StructuredOutputsParams) -> str | None:
        """None for every spec kind, except a JSON schema (or a structural tag holding one)
        with keywords xgrammar would not enforce (unless ``spec.allow_unenforced``): then a
        message naming them."""
        if spec.allow_unenforced or spec.kind not in ("json", "structural_tag"):
            return None
        try:
            if spec.kind == "json":
                schemas = [spec.schema]
            else:
                st = normalise_structural_tag(spec.structural_tag or {})
                schemas = [f["json_schema"] for f in json_schema_formats(st)]
        except ValueError:
            return None  # compile() reports the bad spec text
        unenforced: set[str] = set()
        for schema in schemas:
            unenforced |= xgrammar_unenforced_keywords(schema)
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
        whitespace and additional-properties options, and baton's rewrites of xgrammar's
        EBNF (see ``_rewritten``)."""
        if spec.disable_additional_properties:
            schema = close_object_schemas(schema)
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
            own_options = (
                fmt.get("style", "json") != "json"
                or fmt.get("any_order")
                or fmt.get("excludes")
                or fmt.get("max_whitespace_cnt") is not None
                or set(fmt) - _PLAIN_JSON_FORMAT_KEYS
            )
            if own_options:
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
            return c.compile_grammar(spec.grammar or "")
        if kind == "structural_tag":
            return c.compile_structural_tag(self._structural_tag_text(spec))
        raise ValueError(f"unknown spec kind {kind!r}")

    # ------------------------------------------------------------------ masks

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fills ``bitmask[rows[i]]`` for ``matchers[i]`` with one native call (GIL released).

        Raises:
            TypeError: a matcher is not an ``XGrammarMatcher``.
            ValueError: ``bitmask`` has the wrong dtype, device or width, or the lengths differ.
        """
        if len(matchers) != len(rows):
            raise ValueError(f"{len(matchers)} matchers but {len(rows)} rows")
        self.check_bitmask(bitmask)
        live: list[xgr.GrammarMatcher] = []
        live_rows: list[int] = []
        for matcher, row in zip(matchers, rows, strict=True):
            if not isinstance(matcher, XGrammarMatcher):
                raise TypeError(f"expected an XGrammarMatcher, got {type(matcher).__name__}")
            # The native batch call refuses terminated matchers.
            if matcher.xgr_matcher.is_terminated():
                bitmask[row].copy_(self.eos_row)
            else:
                live.append(matcher.xgr_matcher)
                live_rows.append(int(row))
        if not live:
            return
        if len(live) == 1:  # the batch API's list handling costs more than it saves here
            live[0].fill_next_token_bitmask(bitmask, live_rows[0])
            return
        batch = self._parallel_batch if len(live) >= self._parallel_min_rows else self._serial_batch
        with self._batch_lock:
            batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)


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
