"""The outlines-core backend: regex, choice and JSON-schema constraints as a token-level DFA index.

outlines-core turns a JSON schema into one regular expression and that regex into an ``Index``
(DFA state x token -> state) over the model's vocabulary. Its schema converter reads one keyword
per subschema (``properties`` before ``allOf`` before ``anyOf`` ... before ``type``) and drops
the rest; it concatenates allOf subschemas, writes patterns unescaped into the JSON string, and
drops required properties when its $ref recursion limit hits. So before conversion this module
rewrites the schema into a shape the converter reads faithfully (allOf merged, anyOf/oneOf
siblings pushed into the branches, every $ref inlined with recursion cut where the schema
allows it, patterns translated to JSON-string level, booleans and bare annotations made
explicit) and records every assertion keyword still ignored. ``unsupported_reason`` names those
keywords unless the request sets ``allow_unenforced``.

Choices made here:
  * Sound before complete: where outlines cannot say a constraint exactly it writes a narrower
    one (only listed properties, in schema order; an object schema without "type" writes
    objects; bounded strings and pattern classes never hold escape sequences, which inside a
    counted repetition make the index build exponential).
  * json_object is outlines' own depth-bounded "any object" regex: containers nest at most three
    levels deep (deeper objects are rejected, never produced); compiling it takes seconds.
  * ``format`` is an annotation in JSON Schema 2020-12: date-time, date, time (RFC 3339) and
    uuid are enforced, other formats are ignored rather than refused.
  * Specs whose regex or DFA would be huge are refused (memory: about 1 MB per DFA state).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

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
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.vocab import Vocab, VocabSource, build_vocab

# ---------------------------------------------------------------------------------------------
# The enforcement table. Each entry is backed by a test in tests/test_grammar_outlines.py.

OUTLINES_ENFORCED_KEYWORDS: frozenset[str] = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
    }
)
"""Keywords outlines enforces (after this module's rewriting), except as described in
``OUTLINES_CONDITIONAL_KEYWORDS``. An allOf that cannot be merged into one schema makes the
schema unsupported rather than unenforced."""

OUTLINES_UNENFORCED_KEYWORDS: frozenset[str] = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "$dynamicRef",
        "$recursiveRef",
    }
)
"""Keywords outlines ignores, reported wherever they constrain the values outlines may write
(never for a keyword that cannot matter, e.g. minimum in a string schema), except as described
in ``OUTLINES_CONDITIONAL_KEYWORDS``."""

OUTLINES_CONDITIONAL_KEYWORDS: dict[str, str] = {
    "pattern": "reported in a string schema that also has minLength or maxLength (the length "
    "bound wins)",
    "oneOf": "enforced as anyOf: reported unless its branches are provably disjoint (by type, "
    "by value, or by a required property's const/enum)",
    "minItems": "beside prefixItems (outlines writes the whole tuple): reported when above the "
    "tuple's length",
    "maxItems": "beside prefixItems: reported when below the tuple's length",
    "minProperties": "enforced when no larger than the number of required properties, or 1 on "
    "an object without listed properties",
    "maxProperties": "enforced when no smaller than the number of listed properties, or 0",
    "patternProperties": "enforced where outlines writes only listed properties and none of "
    "their names matches a pattern",
}
"""Exceptions to the two tables above."""

_ALL_TYPES: frozenset[str] = frozenset(
    {"string", "number", "integer", "boolean", "null", "array", "object"}
)
_NUMERIC = frozenset({"number", "integer"})
_STRING = frozenset({"string"})
_ARRAY = frozenset({"array"})
_OBJECT = frozenset({"object"})

# Which instance types each assertion keyword constrains (a keyword cannot be violated by a value
# of another type, so ignoring it there costs nothing).
_KEYWORD_TYPES: dict[str, frozenset[str]] = {
    **dict.fromkeys(
        ("multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"), _NUMERIC
    ),
    **dict.fromkeys(("maxLength", "minLength", "pattern", "format"), _STRING),
    **dict.fromkeys(
        (
            "items",
            "prefixItems",
            "additionalItems",
            "unevaluatedItems",
            "contains",
            "minContains",
            "maxContains",
            "maxItems",
            "minItems",
            "uniqueItems",
        ),
        _ARRAY,
    ),
    **dict.fromkeys(
        (
            "properties",
            "patternProperties",
            "additionalProperties",
            "unevaluatedProperties",
            "propertyNames",
            "required",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
            "maxProperties",
            "minProperties",
        ),
        _OBJECT,
    ),
    **dict.fromkeys(
        (
            "type",
            "enum",
            "const",
            "allOf",
            "anyOf",
            "oneOf",
            "not",
            "if",
            "then",
            "else",
            "$ref",
            "$dynamicRef",
            "$recursiveRef",
        ),
        _ALL_TYPES,
    ),
}
_ASSERTIONS: frozenset[str] = frozenset(_KEYWORD_TYPES)

# One character of JSON string text, no escapes: escapes inside a counted repetition make the
# outlines index build exponential in the count, so bounded strings are produced unescaped.
_SAFE_CHAR = r'[^"\\\x00-\x1F]'
_SAFE_ANY = rf"(?:{_SAFE_CHAR}|\\[\"\\/bfnrt])"
_SAFE_SET = r'[^"\\\x00-\x1F]'
_JSON_SHORT_ESCAPES = {"\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_ECMA_SPACE = r"[ \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}]"

# RFC 3339 (outlines' own date-time has no offsets, its time regex can emit a bare backslash).
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]{1,9})?"
_OFFSET = r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}{_OFFSET}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}{_OFFSET}$",
}
# Formats outlines' own regexes handle safely; its email and uri regexes can emit unescaped
# quotes inside the JSON string, so those are treated as the annotations they are by default.
_NATIVE_FORMATS = frozenset({"uuid"})

DEFAULT_MAX_STATES = 4000
"""Refuse regexes whose estimated DFA size exceeds this: the outlines index holds every state's
transitions over the whole vocabulary (about 1 MB per state for a 49k vocabulary, measured), and
a counted repetition such as maxLength 1000 would take gigabytes."""

_MAX_JUMP_FORWARD_BYTES = 4096


_MAX_RECURSION = 3
_MAX_NODES = 20_000


class _Unsupported(Exception):
    """A schema outlines cannot represent (never merely unenforced)."""


# ---------------------------------------------------------------------------------------------
# Regex text helpers


def regex_literal(text: str) -> str:
    """A Rust-regex that matches exactly ``text`` (ASCII punctuation and controls as \\x{..})."""
    out = []
    for ch in text:
        if (ch.isascii() and ch.isalnum()) or (not ch.isascii() and ch.isprintable()):
            out.append(ch)
        else:
            out.append(f"\\x{{{ord(ch):X}}}")
    return "".join(out)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (as literal strings)."""
    return "(?:" + "|".join(regex_literal(c) for c in choices) + ")"


def _strip_anchors(regex: str) -> str:
    # A regex constraint matches the whole output; outlines' DFA has no anchor at the ends
    # (a leading "^" makes the index fail), so explicit anchors are dropped.
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex) - 1 - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            regex = regex[:-1]
    return regex


def _json_char(ch: str) -> str:
    """Regex for the JSON-string text of one character (quotes, backslashes, controls escaped)."""
    if ch == '"':
        return r'(?:\\")'
    if ch == "\\":
        return r"(?:\\\\)"
    if ord(ch) < 0x20:
        short = _JSON_SHORT_ESCAPES.get(ch)
        if short is not None:
            return rf"(?:\\{short})"
        hi, lo = f"{ord(ch):04X}"[2], f"{ord(ch):04X}"[3]
        lo_re = f"[{lo}{lo.lower()}]" if lo.isalpha() else lo
        return rf"(?:\\u00{hi}{lo_re})"
    return regex_literal(ch)


def _split_top_level(pattern: str) -> list[str]:
    """Splits a pattern at its top-level ``|``."""
    parts, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if pattern.startswith("[^]", i) or pattern.startswith("[]", i):
                i += 1
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _read_escape(pattern: str, i: int) -> tuple[str, str | None, int]:
    """Reads the escape at ``pattern[i] == '\\'``: (kind, value, next index).

    kind is "char" (value: the character), "class" (value: the class letter or a \\p{..} text),
    or "error" (value: why).
    """
    if i + 1 >= len(pattern):
        return "error", "pattern ends with a lone backslash", i + 1
    nxt = pattern[i + 1]
    j = i + 2
    if nxt in "dDwWsS":
        return "class", nxt, j
    if nxt in "pP":
        if j < len(pattern) and pattern[j] == "{":
            end = pattern.find("}", j)
            if end < 0:
                return "error", "unterminated \\p{...}", len(pattern)
            return "class", pattern[i : end + 1], end + 1
        return "class", pattern[i : j + 1], j + 1
    if nxt in "bB":
        return "error", "word boundaries (\\b, \\B) are not supported", j
    if nxt in "123456789" or nxt == "k":
        return "error", "backreferences are not supported", j
    simple = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v"}
    if nxt in simple:
        return "char", simple[nxt], j
    if nxt == "0" and not (j < len(pattern) and pattern[j].isdigit()):
        return "char", "\0", j
    if nxt == "c" and j < len(pattern) and pattern[j].isalpha():
        return "char", chr(ord(pattern[j]) % 32), j + 1
    if nxt in "xu":
        if j < len(pattern) and pattern[j] == "{":
            end = pattern.find("}", j)
            digits = pattern[j + 1 : end] if end > 0 else ""
            j = end + 1
        else:
            width = 2 if nxt == "x" else 4
            digits = pattern[j : j + width]
            j += width
        try:
            code = int(digits, 16)
            if not 0 <= code <= 0x10FFFF:
                raise ValueError
        except ValueError:
            return "error", f"bad \\{nxt} escape", j
        if 0xD800 <= code < 0xDC00 and pattern.startswith("\\u", j):
            low = pattern[j + 2 : j + 6]
            if re.fullmatch(r"[dD][c-fC-F][0-9a-fA-F]{2}", low):
                code = 0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)
                j += 6
        return "char", chr(code), j
    return "char", nxt, j


_ASCII_CLASSES = {"d": "[0-9]", "w": "[0-9A-Za-z_]"}
_NEGATED_ASCII = {"D": "[^0-9]", "W": "[^0-9A-Za-z_]"}


def _class_item(kind: str, value: str) -> str:
    """A class escape as an item inside a Rust bracket class (ECMA semantics: ASCII \\d, \\w)."""
    if kind == "class":
        if value in _ASCII_CLASSES:
            return _ASCII_CLASSES[value]
        if value in _NEGATED_ASCII:
            return _NEGATED_ASCII[value]
        if value in "sS":
            return "\\" + value
        return value  # \p{..} / \P{..}
    return f"\\x{{{ord(value):X}}}"


def _read_class(pattern: str, i: int) -> tuple[str, int]:
    """Reads the bracket class at ``pattern[i] == '['``; returns a Rust class intersected with
    the characters a JSON string may hold unescaped, and the next index."""
    j = i + 1
    negated = j < len(pattern) and pattern[j] == "^"
    if negated:
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        raise _Unsupported("empty character classes ([] or [^]) are not supported")
    items: list[str] = []
    safe = not negated  # every member is a character JSON writes unescaped
    while True:
        if j >= len(pattern):
            raise _Unsupported("unterminated character class")
        ch = pattern[j]
        if ch == "]":
            j += 1
            break
        if ch == "\\":
            kind, value, j = _read_escape(pattern, j)
            if kind == "error":
                if value and value.startswith("word boundaries"):
                    kind, value = "char", "\b"  # ECMA: [\b] is a backspace
                else:
                    raise _Unsupported(value or "bad escape")
            assert value is not None
            lo_item = _class_item(kind, value)
            lo_char = value if kind == "char" else None
            safe = safe and (lo_char is not None or value in _ASCII_CLASSES)
        elif ch == "[" and pattern.startswith("[:", j):
            end = pattern.find(":]", j)
            if end < 0:
                raise _Unsupported("unterminated [: :] class")
            lo_item, lo_char, j = "[" + pattern[j : end + 2] + "]", None, end + 2
            safe = False
        else:
            lo_item, lo_char, j = f"\\x{{{ord(ch):X}}}", ch, j + 1
        if (
            lo_char is not None
            and j + 1 < len(pattern)
            and pattern[j] == "-"
            and pattern[j + 1] != "]"
        ):
            if pattern[j + 1] == "\\":
                kind, value, k = _read_escape(pattern, j + 1)
                if kind != "char" or value is None:
                    raise _Unsupported("a class range must end with a character")
                hi_char = value
            else:
                hi_char, k = pattern[j + 1], j + 2
            if ord(hi_char) < ord(lo_char):
                raise _Unsupported(f"class range out of order: {lo_char!r}-{hi_char!r}")
            items.append(f"\\x{{{ord(lo_char):X}}}-\\x{{{ord(hi_char):X}}}")
            safe = safe and _safe_range(lo_char, hi_char)
            j = k
            continue
        if lo_char is not None:
            safe = safe and _safe_range(lo_char, lo_char)
        items.append(lo_item)
    inner = "".join(items)
    if safe:
        return f"[{inner}]", j
    return f"[[{'^' if negated else ''}{inner}]&&{_SAFE_SET}]", j


def _safe_range(lo: str, hi: str) -> bool:
    """Whether every character in lo..hi appears unescaped in JSON text."""
    a, b = ord(lo), ord(hi)
    return a >= 0x20 and not (a <= 0x22 <= b) and not (a <= 0x5C <= b)


def json_string_pattern(pattern: str) -> str:
    """Translates a JSON-schema ``pattern`` into a regex over the text between a JSON string's
    quotes, for outlines-core (Rust regex syntax).

    The schema pattern is an ECMA-262 regex searched in the decoded string: an unanchored side
    gets free text, a quote or backslash or control character is matched in its escaped JSON
    form, wildcards and classes exclude the characters JSON would need to escape (sound: such
    characters are never produced by them), and \\d, \\w are ASCII as in ECMA-262.

    Raises:
        GrammarError: a construct outlines' DFA cannot represent (lookaround, backreference,
            word boundary, an anchor inside the pattern) or a syntax error.
    """
    try:
        branches = []
        for branch in _split_top_level(pattern):
            anchored_start = branch.startswith("^")
            if anchored_start:
                branch = branch[1:]
            anchored_end = False
            if branch.endswith("$"):
                backslashes = len(branch) - 1 - len(branch[:-1].rstrip("\\"))
                if backslashes % 2 == 0:
                    anchored_end, branch = True, branch[:-1]
            body = _pattern_body(branch)
            free = f"{_SAFE_ANY}*"  # escapes are cheap outside counted repetitions
            branches.append(
                ("" if anchored_start else free) + f"(?:{body})" + ("" if anchored_end else free)
            )
        return "(?:" + "|".join(branches) + ")"
    except _Unsupported as exc:
        raise GrammarError(f"pattern {pattern!r}: {exc}") from None


def _pattern_body(body: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            kind, value, i = _read_escape(body, i)
            if kind == "error":
                raise _Unsupported(value or "bad escape")
            assert value is not None
            if kind == "char":
                out.append(_json_char(value))
            elif value in _ASCII_CLASSES:
                out.append(_ASCII_CLASSES[value])
            elif value == "s":
                out.append(rf"(?:{_ECMA_SPACE}|\\[tnrf]|\\u000[bB])")
            else:
                out.append(f"[{_class_item(kind, value)}&&{_SAFE_SET}]")
        elif ch == "[":
            text, i = _read_class(body, i)
            out.append(text)
        elif ch == ".":
            out.append(r'[^"\\\x00-\x1F\x{2028}\x{2029}]')
            i += 1
        elif ch in "^$":
            raise _Unsupported("anchors (^, $) are supported only at the ends of the pattern")
        elif ch == "(":
            if body.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                raise _Unsupported("lookaround assertions are not supported")
            if body.startswith("(?<", i) or body.startswith("(?P<", i):
                end = body.find(">", i)
                if end < 0:
                    raise _Unsupported("unterminated group name")
                out.append("(?:")
                i = end + 1
            elif body.startswith("(?:", i):
                out.append("(?:")
                i += 3
            elif body.startswith("(?", i):
                raise _Unsupported("inline flags and other (?...) groups are not supported")
            else:
                out.append("(?:")
                i += 1
        elif ch == "{":
            m = re.compile(r"\{\d+(?:,\d*)?\}").match(body, i)
            if m:
                out.append(m.group())
                i = m.end()
            else:
                out.append(_json_char(ch))
                i += 1
        elif ch in "*+?)|":
            out.append(ch)
            i += 1
        else:
            out.append(_json_char(ch))
            i += 1
    return "".join(out)


def estimate_dfa_states(regex: str) -> int:
    """A rough estimate of the DFA size outlines builds for ``regex``: atoms count 1, a counted
    repetition multiplies what it repeats, by 8 more when that may match non-ASCII (UTF-8 byte
    states). Used only to refuse specs that would exhaust memory (measured: maxLength 1000 is
    about 8000 states and 6 GB)."""
    quantifier = re.compile(r"\{(\d+)(?:,(\d*))?\}")
    # Per open group: [sum of closed alternatives, current alternative, last atom, last wide,
    # any wide atom in the group].
    stack: list[list[Any]] = [[0, 0, 0, False, False]]

    def atom(weight: int, wide: bool) -> None:
        frame = stack[-1]
        frame[1] += weight
        frame[2], frame[3] = weight, wide
        frame[4] = frame[4] or wide

    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\":
            nxt = regex[i + 1 : i + 2]
            j = i + 2
            if nxt in ("x", "u", "p", "P") and regex.startswith("{", j):
                end = regex.find("}", j)
                j = end + 1 if end > 0 else n
            atom(1, nxt in ("D", "W", "S", "d", "w", "s", "p", "P"))
            i = j
        elif ch == "[":
            depth, j, wide = 0, i, False
            while j < n:
                c = regex[j]
                if c == "\\":
                    wide = wide or regex[j + 1 : j + 2] in ("D", "W", "S", "d", "w", "s", "p", "P")
                    j += 2
                    continue
                if c == "[":
                    depth += 1
                    wide = wide or regex.startswith("[^", j)
                elif c == "]":
                    depth -= 1
                    if depth == 0:
                        break
                elif not c.isascii():
                    wide = True
                j += 1
            atom(1, wide)
            i = j + 1
        elif ch == "(":
            stack.append([0, 0, 0, False, False])
            i += 3 if regex.startswith("(?:", i) else 1
        elif ch == "|":
            stack[-1][0] += stack[-1][1]
            stack[-1][1] = 0
            i += 1
        elif ch == ")" and len(stack) > 1:
            frame = stack.pop()
            atom(max(frame[0] + frame[1], 1), frame[4])
            i += 1
        elif ch == "{" and (m := quantifier.match(regex, i)):
            low = int(m.group(1))
            times = max(low, int(m.group(2)) if m.group(2) else low, 1)
            frame = stack[-1]
            repeated = frame[2] * (8 if frame[3] and times > 1 else 1) * times
            frame[1] += repeated - frame[2]
            frame[2] = repeated
            i = m.end()
        elif ch in "*+?":
            i += 1
        else:
            atom(1, False)
            i += 1
    while len(stack) > 1:
        frame = stack.pop()
        stack[-1][1] += frame[0] + frame[1]
    return stack[0][0] + stack[0][1]


# ---------------------------------------------------------------------------------------------
# Schema rewriting and the unenforced-keyword walk


def _canon(value: Any) -> str:
    """JSON equality key: 1 and 1.0 are equal, True and 1 are not."""

    def norm(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    return json.dumps(norm(value), sort_keys=True)


def _value_types(value: Any) -> frozenset[str]:
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if value is None:
        return frozenset({"null"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"integer", "number"}) if value.is_integer() else frozenset({"number"})
    if isinstance(value, str):
        return _STRING
    if isinstance(value, list):
        return _ARRAY
    return _OBJECT


def _types_of(node: dict[str, Any]) -> frozenset[str]:
    t = node.get("type")
    if isinstance(t, str):
        names = {t}
    elif isinstance(t, list):
        names = {x for x in t if isinstance(x, str)}
    else:
        return _ALL_TYPES
    if "number" in names:
        names.add("integer")
    return frozenset(names & _ALL_TYPES)


def _type_intersection(a: Any, b: Any) -> list[str]:
    def expand(t: Any) -> set[str]:
        names = {t} if isinstance(t, str) else set(t)
        return names

    sa, sb = expand(a), expand(b)
    out = sa & sb
    if "number" in sa and "integer" in sb:
        out.add("integer")
    if "integer" in sa and "number" in sb:
        out.add("integer")
    order = ["null", "boolean", "object", "array", "number", "integer", "string"]
    return [t for t in order if t in out]


def _trivial(keyword: str, value: Any) -> bool:
    """True when the keyword cannot reject anything."""
    if keyword in ("minLength", "minItems", "minProperties", "minContains") and value == 0:
        return True
    if keyword == "uniqueItems" and value is False:
        return True
    if keyword in ("required", "dependentRequired", "dependentSchemas", "dependencies"):
        return not value
    return keyword in ("patternProperties", "properties") and not value


def _json_key(name: str) -> str:
    """A property name as it appears between the quotes in JSON text."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _is_legacy_draft(root: Any) -> bool:
    schema = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(schema, str) and bool(re.search(r"draft-0[3-7]", schema))


@dataclass(frozen=True)
class PreparedSchema:
    """A schema rewritten for outlines-core's converter.

    Attributes:
        schema: the rewritten schema (JSON-serialisable).
        unenforced: assertion keywords outlines would ignore, sorted.
        error: why outlines cannot take the schema at all, or None.
    """

    schema: Any
    unenforced: tuple[str, ...]
    error: str | None


class _Preparer:
    """One rewriting pass over a schema (see the module docstring)."""

    def __init__(self, root: Any, disable_additional_properties: bool) -> None:
        self.root = root
        self.disable_additional = disable_additional_properties
        self.legacy_ref = _is_legacy_draft(root)
        self.root_id = (root.get("$id") or root.get("id")) if isinstance(root, dict) else None
        self.unenforced: set[str] = set()
        # $ref targets being expanded (outlines' own $ref handling drops a required property
        # when it hits its recursion limit, so every $ref is inlined here, cut soundly).
        self.expanding: list[str] = []
        self.nodes = 0

    # -- references --
    def _pointer(self, ref: Any) -> str:
        if not isinstance(ref, str):
            raise _Unsupported("$ref must be a string")
        base, sep, fragment = ref.partition("#")
        if base and base != self.root_id:
            raise _Unsupported(f"only local $ref are supported, got {ref!r}")
        if fragment and not fragment.startswith("/"):
            raise _Unsupported(f"$ref to an anchor is not supported: {ref!r}")
        return fragment

    def _resolve(self, pointer: str) -> Any:
        node = self.root
        for raw in pointer.split("/")[1:]:
            part = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _Unsupported(f"$ref target not found: #{pointer}")
        return node

    def _inline(self, node: Any) -> tuple[Any, str | None]:
        """A subschema with a local $ref replaced by its target merged with the $ref's siblings
        (None: they cannot be merged; False: the recursion limit cuts here)."""
        if node is True:
            return {}, None
        if isinstance(node, dict) and "$ref" in node:
            pointer = self._pointer(node["$ref"])
            if self.expanding.count(pointer) >= _MAX_RECURSION:
                return False, None
            target = self._resolve(pointer)
            if target is True:
                target = {}
            if target is False:
                return False, None
            if not isinstance(target, dict):
                raise _Unsupported(f"$ref target #{pointer} is not a schema")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            if self.legacy_ref:
                rest = {k: v for k, v in rest.items() if k not in _ASSERTIONS}
            if not _cousins_ok([rest, target]):
                return None, pointer
            return _merge(target, rest), pointer
        return node, None

    # -- merging (allOf, siblings of anyOf/oneOf/$ref) --
    def _merge_all(self, parts: list[Any]) -> Any:
        """Merges a parent (``parts[0]``) with applicator members (allOf entries, one anyOf or
        oneOf branch) into one prepared schema; None when the merge cannot be said, False when
        nothing matches."""
        merged: dict[str, Any] = {}
        pushed: list[str] = []
        try:
            inlined = []
            for part in parts:
                if part is False:
                    return False
                part, pointer = self._inline(part)
                if part is None or part is False:
                    return part
                if pointer is not None:
                    self.expanding.append(pointer)
                    pushed.append(pointer)
                inlined.append(part)
            if not _cousins_ok(inlined):
                return None
            for part in inlined:
                result = _merge(merged, part)
                if result is None:
                    return None
                merged = result
            return self.prep_dict(merged)
        finally:
            for _ in pushed:
                self.expanding.pop()

    # -- the walk --
    def run(self) -> PreparedSchema:
        try:
            root = self.root
            if root is False:
                raise _Unsupported("the schema false matches nothing")
            prepared = self.prep(root)
            if prepared is False:
                raise _Unsupported(
                    "the schema matches nothing (within the recursion limit of "
                    f"{_MAX_RECURSION} nested uses of one $ref)"
                )
            return PreparedSchema(
                _wrap_any(prepared, top=True), tuple(sorted(self.unenforced)), None
            )
        except _Unsupported as exc:
            return PreparedSchema(None, tuple(sorted(self.unenforced)), str(exc))
        except GrammarError as exc:
            return PreparedSchema(None, tuple(sorted(self.unenforced)), str(exc))
        except RecursionError:
            return PreparedSchema(None, (), "schema nesting is too deep")

    def prep(self, node: Any) -> Any:
        """The rewritten subschema, or False when it matches nothing."""
        if node is True:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise _Unsupported(f"a subschema must be an object or a boolean, got {node!r}")
        return self.prep_dict(dict(node))

    def flag(self, node: dict[str, Any], out_types: frozenset[str], honoured: set[str]) -> None:
        """Reports the assertion keywords of ``node`` outlines ignores here."""
        for key, value in node.items():
            if key not in _ASSERTIONS or key in honoured or _trivial(key, value):
                continue
            if key in ("then", "else") and "if" not in node:
                continue
            if key == "if" and "then" not in node and "else" not in node:
                continue
            if key in ("minContains", "maxContains") and "contains" not in node:
                continue
            if key == "format":
                continue
            if _KEYWORD_TYPES[key] & out_types:
                self.unenforced.add(key)

    def prep_dict(self, node: dict[str, Any]) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise _Unsupported(
                f"the schema expands to more than {_MAX_NODES} subschemas once its $ref are "
                "inlined: too large for outlines-core"
            )
        for key in _COUNT_KEYWORDS:
            if key in node and (count := _count(node[key])) is not None:
                node[key] = count
        if self.legacy_ref and "$ref" in node:
            node = {k: v for k, v in node.items() if k == "$ref" or k not in _ASSERTIONS}
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            node.pop("additionalItems", None)
        node.pop("additionalItems", None)
        if "allOf" in node:
            members = node.pop("allOf")
            if not isinstance(members, list):
                raise _Unsupported("allOf must be an array")
            merged = self._merge_all([node, *members])
            if merged is False:
                return False
            if merged is None:
                raise _Unsupported(
                    "allOf: outlines-core concatenates allOf subschemas, and these could not be "
                    "merged into one schema"
                )
            return merged
        for key in ("anyOf", "oneOf"):
            if key in node:
                return self.prep_alternatives(node, key)
        if "$ref" in node:
            return self.prep_ref(node)
        if "properties" in node:
            return self.prep_properties(node)
        if "prefixItems" in node:
            return self.prep_prefix_items(node)
        if "enum" in node or "const" in node:
            return self.prep_enum(node)
        if "type" in node:
            return self.prep_type(node)
        families = {
            _KEYWORD_TYPES[k] for k, v in node.items() if k in _ASSERTIONS and not _trivial(k, v)
        }
        if len(families) == 1 and next(iter(families)) != _ALL_TYPES:
            # Keywords of one type only: write that type (outlines does the same for
            # properties); other types would satisfy the schema too, so this only narrows.
            family = next(iter(families))
            return self.prep_dict({**node, "type": "number" if family == _NUMERIC else min(family)})
        self.flag(node, _ALL_TYPES, set())
        return {}

    def prep_alternatives(self, node: dict[str, Any], key: str) -> Any:
        branches = node.pop(key)
        if not isinstance(branches, list) or not branches:
            raise _Unsupported(f"{key} must be a non-empty array")
        siblings = {k: v for k, v in node.items() if k in _ASSERTIONS}
        out: list[Any] = []
        for branch in branches:
            if siblings:
                merged = self._merge_all([siblings, branch])
                if merged is None:
                    self.flag(siblings, _ALL_TYPES, set())
                    merged = self.prep(branch)
            else:
                merged = self.prep(branch)
            if merged is not False:
                out.append(merged)
        if not out:
            return False
        if key == "oneOf" and len(out) > 1 and not _pairwise_disjoint(out):
            self.unenforced.add("oneOf")
        if len(out) == 1:
            return out[0]
        if any(b == {} for b in out):
            return {}
        return {"anyOf": out}

    def prep_ref(self, node: dict[str, Any]) -> Any:
        siblings = {k: v for k, v in node.items() if k in _ASSERTIONS and k != "$ref"}
        if siblings:
            merged = self._merge_all([node])
            if merged is not None:
                return merged
            self.flag(siblings, _ALL_TYPES, set())
        pointer = self._pointer(node["$ref"])
        if self.expanding.count(pointer) >= _MAX_RECURSION:
            return False  # recursion cut: this value is not written (its parent decides)
        self.expanding.append(pointer)
        try:
            return self.prep(self._resolve(pointer))
        finally:
            self.expanding.pop()

    def prep_properties(self, node: dict[str, Any]) -> Any:
        types = _types_of(node)
        if "object" not in types:
            # Only non-objects are allowed, and object keywords say nothing about them.
            node = {k: v for k, v in node.items() if _KEYWORD_TYPES.get(k) != _OBJECT}
            return self.prep_dict(node)
        if "type" in node and types != _OBJECT:
            # outlines writes only the object: the other types become their own branch.
            raw = node["type"]
            others = [t for t in ([raw] if isinstance(raw, str) else raw) if t != "object"]
            object_part = {**node, "type": "object"}
            rest = {k: v for k, v in node.items() if _KEYWORD_TYPES.get(k) != _OBJECT}
            rest["type"] = others
            return self.prep_alternatives({"anyOf": [object_part, rest]}, "anyOf")
        props_in = node.get("properties", {})
        if not isinstance(props_in, dict):
            raise _Unsupported("properties must be an object")
        required = [r for r in node.get("required", []) if isinstance(r, str)]
        additional = node.get("additionalProperties", True)
        if self.disable_additional and "additionalProperties" not in node:
            additional = False
        props: dict[str, Any] = {}
        for name, sub in props_in.items():
            prepared = self.prep(sub)
            if prepared is False:
                if name in required:
                    return False
                continue
            props[name] = prepared
        for name in required:
            if name in props:
                continue
            if additional is False and "additionalProperties" in node:
                return False  # a required property the schema does not allow
            # outlines only writes listed properties: list the missing required ones.
            prepared = self.prep(additional) if isinstance(additional, dict) else {}
            if prepared is False:
                return False
            props[name] = prepared
        honoured = {
            "properties",
            "required",
            "additionalProperties",
            "unevaluatedProperties",
            "type",
        }
        n_required = len(set(required))
        if node.get("minProperties", 0) <= n_required:
            honoured.add("minProperties")
        if isinstance(node.get("maxProperties"), int) and node["maxProperties"] >= len(props):
            honoured.add("maxProperties")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and not any(
            _py_search(p, name) for p in patterns for name in props
        ):
            honoured.add("patternProperties")
        self.flag(node, _OBJECT, honoured)
        # outlines regex-escapes names but does not JSON-escape them: hand it the JSON text.
        out: dict[str, Any] = {
            "type": "object",
            "properties": {_json_key(k): v for k, v in props.items()},
        }
        if required:
            out["required"] = [_json_key(r) for r in dict.fromkeys(required) if r in props]
        return out

    def prep_prefix_items(self, node: dict[str, Any]) -> Any:
        types = _types_of(node)
        if "array" not in types:
            node = {k: v for k, v in node.items() if _KEYWORD_TYPES.get(k) != _ARRAY}
            return self.prep_dict(node)
        items = node["prefixItems"]
        if not isinstance(items, list):
            raise _Unsupported("prefixItems must be an array")
        prepared = [self.prep(i) for i in items]
        if any(p is False for p in prepared):
            return False
        honoured = {"prefixItems", "items", "type", "unevaluatedItems"}
        if node.get("minItems", 0) <= len(items):
            honoured.add("minItems")
        if node.get("maxItems", len(items)) >= len(items):
            honoured.add("maxItems")
        self.flag(node, _ARRAY, honoured)
        return {"prefixItems": prepared}

    def prep_enum(self, node: dict[str, Any]) -> Any:
        if "enum" in node:
            values = node["enum"]
            if not isinstance(values, list) or not values:
                raise _Unsupported("enum must be a non-empty array")
        else:
            values = [node["const"]]
        if "enum" in node and "const" in node:
            keep = _canon(node["const"])
            values = [v for v in values if _canon(v) == keep]
        types = _types_of(node)
        values = [v for v in values if _value_types(v) & types]
        if not values:
            return False
        out_types = frozenset().union(*(_value_types(v) for v in values))
        self.flag(node, out_types, {"enum", "const", "type"})
        scalars = [v for v in values if not isinstance(v, (dict, list))]
        # outlines' enum takes scalars only: objects and arrays become exact schemas.
        parts = [_const_schema(v) for v in values if isinstance(v, (dict, list))]
        if scalars:
            parts.insert(0, {"enum": scalars})
        return parts[0] if len(parts) == 1 else {"anyOf": parts}

    def prep_type(self, node: dict[str, Any]) -> Any:
        raw = node["type"]
        names = [raw] if isinstance(raw, str) else raw
        if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
            raise _Unsupported("type must be a string or an array of strings")
        unknown = [t for t in names if t not in _ALL_TYPES]
        if unknown:
            raise _Unsupported(f"unknown type {unknown[0]!r}")
        names = list(dict.fromkeys(names))
        if "number" in names and "integer" in names:
            names.remove("integer")
        honoured: set[str] = {"type"}
        parts: list[Any] = []
        for t in names:
            part = self._type_part(t, node, honoured)
            if part is not False:
                parts.append(part)
        self.flag(node, _types_of(node), honoured)
        if not parts:
            return False
        return parts[0] if len(parts) == 1 else {"anyOf": parts}

    def _type_part(self, t: str, node: dict[str, Any], honoured: set[str]) -> Any:
        if t == "string":
            return self._string_part(node, honoured)
        if t == "array":
            honoured.update({"items", "minItems", "maxItems", "unevaluatedItems"})
            out: dict[str, Any] = {"type": "array"}
            # With no items keyword, unevaluatedItems applies to every item, like items.
            items = node.get("items", node.get("unevaluatedItems", True))
            prepared = self.prep(items)
            min_items, max_items = node.get("minItems", 0), node.get("maxItems")
            if prepared is False:
                if min_items > 0:
                    return False
                max_items = 0
            elif items is not True:
                out["items"] = prepared
            if isinstance(min_items, int) and min_items > 0:
                out["minItems"] = min_items
            if isinstance(max_items, int):
                if max_items < min_items:
                    return False
                out["maxItems"] = max_items
            return out
        if t == "object":
            additional = node.get("additionalProperties", True)
            if "additionalProperties" not in node and "patternProperties" not in node:
                # With nothing else evaluating properties, unevaluatedProperties is
                # additionalProperties.
                additional = node.get("unevaluatedProperties", True)
                honoured.add("unevaluatedProperties")
            if self.disable_additional and "additionalProperties" not in node:
                additional = False
            if additional is False or node.get("required"):
                # An object with only (required) listed properties is what outlines writes.
                honoured.update(k for k, v in _KEYWORD_TYPES.items() if v == _OBJECT)
                closed = {**node, "type": "object", "properties": {}}
                if additional is not True:
                    closed["additionalProperties"] = additional
                return self.prep_properties(closed)
            honoured.update({"additionalProperties"})
            if node.get("minProperties", 0) <= 1:
                honoured.add("minProperties")
            if node.get("maxProperties") == 0:
                honoured.add("maxProperties")
            out = {"type": "object"}
            if additional is not True:
                prepared = self.prep(additional)
                if prepared is not False and prepared != {}:
                    out["additionalProperties"] = prepared
            if node.get("minProperties", 0) >= 1:
                out["minProperties"] = 1
            if node.get("maxProperties") == 0:
                out["maxProperties"] = 0
            return out
        return {"type": t}

    def _string_part(self, node: dict[str, Any], honoured: set[str]) -> Any:
        honoured.update({"minLength", "maxLength"})
        low, high = node.get("minLength"), node.get("maxLength")
        if low is not None or high is not None:
            lo = int(low) if isinstance(low, (int, float)) else 0
            hi = "" if high is None else str(int(high))
            if high is not None and int(high) < lo:
                return False
            return {"type": "string", "pattern": f"{_SAFE_CHAR}{{{lo},{hi}}}"}
        if "pattern" in node:
            honoured.add("pattern")
            if not isinstance(node["pattern"], str):
                raise _Unsupported("pattern must be a string")
            return {"type": "string", "pattern": json_string_pattern(node["pattern"])}
        fmt = node.get("format")
        if fmt in _FORMAT_PATTERNS:
            return {"type": "string", "pattern": json_string_pattern(_FORMAT_PATTERNS[fmt])}
        if fmt in _NATIVE_FORMATS:
            return {"type": "string", "format": fmt}
        return {"type": "string"}


_ANY_WRAPPED: dict[str, Any] = {"anyOf": [{}]}
_COUNT_KEYWORDS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


def _wrap_any(node: Any, top: bool) -> Any:
    """Replaces nested ``{}`` by ``{"anyOf": [{}]}``: outlines writes the any-value regex as a
    bare alternation, which breaks the regex it is embedded in (``[{}]`` would match "[1,2,3").
    """
    if not isinstance(node, dict):
        return node
    if not node:
        return node if top else _ANY_WRAPPED
    out = dict(node)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _wrap_any(v, False) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _wrap_any(out[key], False)
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [_wrap_any(v, False) for v in out["prefixItems"]]
    if isinstance(out.get("anyOf"), list) and out is not _ANY_WRAPPED and out["anyOf"] != [{}]:
        out["anyOf"] = [_wrap_any(v, False) for v in out["anyOf"]]
    return out


def _count(value: Any) -> int | None:
    """A count keyword's value as an int (JSON Schema allows 2.0), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None


def _cousins_ok(parts: list[dict[str, Any]]) -> bool:
    """Whether merging ``parts`` (a parent, then applicator members) keeps the meaning of the
    members' unevaluatedProperties/unevaluatedItems, which cannot see their cousins' keywords."""
    for i, member in enumerate(parts[1:], start=1):
        others = [p for j, p in enumerate(parts) if j != i]
        if member.get("unevaluatedProperties", True) is not True:
            mine = set(member.get("properties", {}) or {})
            theirs = set().union(*(set(p.get("properties", {}) or {}) for p in others))
            if theirs - mine or any("patternProperties" in p for p in others):
                return False
        if member.get("unevaluatedItems", True) is not True and "items" not in member:
            mine_len = len(member.get("prefixItems", []) or [])
            for p in others:
                if "items" in p or len(p.get("prefixItems", []) or []) > mine_len:
                    return False
    return True


def _const_schema(value: Any) -> dict[str, Any]:
    """A schema outlines turns into exactly ``value`` (key order as given)."""
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {_json_key(k): _const_schema(v) for k, v in value.items()},
            "required": [_json_key(k) for k in value],
        }
    if isinstance(value, list):
        if not value:
            return {"type": "array", "maxItems": 0}
        return {"prefixItems": [_const_schema(v) for v in value]}
    return {"enum": [value]}


def _py_search(pattern: str, text: str) -> bool:
    """Whether an ECMA pattern may match ``text`` (Python's re as the approximation; a pattern
    Python cannot read counts as matching, the cautious answer)."""
    try:
        return re.search(pattern, text) is not None
    except (re.error, TypeError):
        return True


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The conjunction of two schemas as one schema, or None when this merge cannot say it."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
            continue
        mine = out[key]
        if _canon(mine) == _canon(value) or key not in _ASSERTIONS:
            continue
        if key == "required":
            out[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "type":
            types = _type_intersection(mine, value)
            if not types:
                return None
            out[key] = types
        elif key == "enum":
            keys = {_canon(v) for v in value}
            out[key] = [v for v in mine if _canon(v) in keys]
        elif key in ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"):
            out[key] = max(mine, value)
        elif key in ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"):
            out[key] = min(mine, value)
        elif key == "uniqueItems":
            out[key] = bool(mine or value)
        elif key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            props = dict(mine)
            for name, sub in value.items():
                if name in props and _canon(props[name]) != _canon(sub):
                    props[name] = {"allOf": [props[name], sub]}
                else:
                    props.setdefault(name, sub)
            out[key] = props
        elif key in ("items", "additionalProperties", "propertyNames") and all(
            isinstance(x, (dict, bool)) for x in (mine, value)
        ):
            out[key] = {"allOf": [mine, value]}
        elif key in OUTLINES_UNENFORCED_KEYWORDS and key not in OUTLINES_CONDITIONAL_KEYWORDS:
            continue  # reported as unenforced anyway: which copy is kept does not matter
        else:
            return None
    # additionalProperties (and kin) of one side only see that side's own properties.
    for x, y in ((a, b), (b, a)):
        closes = any(
            k in x and x[k] is not True for k in ("additionalProperties", "patternProperties")
        )
        extra = set(y.get("properties", {}) or {}) - set(x.get("properties", {}) or {})
        if closes and extra:
            return None
    return out


def _signature(schema: Any) -> tuple[frozenset[str] | None, set[str] | None, dict[str, set[str]]]:
    """(types it can take, exact values, required-property discriminators) of a prepared branch."""
    if not isinstance(schema, dict) or not schema:
        return None, None, {}
    if "enum" in schema:
        values = schema["enum"]
        return (
            frozenset().union(*(_value_types(v) for v in values)),
            {_canon(v) for v in values},
            {},
        )
    if "properties" in schema:
        disc: dict[str, set[str]] = {}
        for name in schema.get("required", []):
            sub = schema["properties"].get(name)
            if isinstance(sub, dict) and "enum" in sub:
                disc[name] = {_canon(v) for v in sub["enum"]}
        return _OBJECT, None, disc
    if "prefixItems" in schema:
        return _ARRAY, None, {}
    if "type" in schema:
        return _types_of(schema), None, {}
    return None, None, {}


def _pairwise_disjoint(branches: list[Any]) -> bool:
    sigs = [_signature(b) for b in branches]
    for i in range(len(sigs)):
        for j in range(i + 1, len(sigs)):
            (ti, vi, di), (tj, vj, dj) = sigs[i], sigs[j]
            if ti is not None and tj is not None and not (ti & tj):
                continue
            if vi is not None and vj is not None and not (vi & vj):
                continue
            if any(name in dj and not (di[name] & dj[name]) for name in di):
                continue
            return False
    return True


def prepare_schema(schema: Any, disable_additional_properties: bool = False) -> PreparedSchema:
    """Rewrites ``schema`` for outlines-core's converter and lists what it would not enforce.

    Returns a ``PreparedSchema``; its ``error`` says why outlines cannot take the schema at all
    (the schema false, allOf it cannot merge, a pattern its DFA cannot express...).
    """
    return _Preparer(schema, disable_additional_properties).run()


def outlines_unenforced_keywords(schema: Any) -> set[str]:
    """Assertion keywords present in ``schema`` (reachable subschemas, $ref followed) that
    outlines-core would not enforce; see ``OUTLINES_UNENFORCED_KEYWORDS`` and
    ``OUTLINES_CONDITIONAL_KEYWORDS``."""
    return set(prepare_schema(schema).unenforced)


def whitespace_pattern(whitespace: str, max_whitespace_cnt: int) -> str:
    """The regex outlines puts between JSON tokens: none for "compact", else at most
    ``max_whitespace_cnt`` spaces, newlines or tabs."""
    if whitespace == "compact":
        return ""
    return f"[ \\n\\t]{{0,{max_whitespace_cnt}}}"


@lru_cache(maxsize=4)
def _base_sizes(ws: str) -> dict[str, int]:
    """Lengths of the regexes outlines writes for unconstrained values, for ``ws``."""
    return {
        name: len(build_regex_from_schema(json.dumps(schema), ws))
        for name, schema in (
            ("any", {}),
            ("object", {"type": "object"}),
            ("array", {"type": "array"}),
            ("string", {"type": "string"}),
            ("number", {"type": "number"}),
            ("integer", {"type": "integer"}),
            ("uuid", {"type": "string", "format": "uuid"}),
        )
    }


def predict_regex_chars(schema: Any, ws: str = "") -> int:
    """The length of the regex outlines would write for a prepared (``$ref``-free) schema,
    computed without writing it: outlines repeats subregexes (array items twice, optional
    properties once per later property), so a schema of a few kilobytes can become a regex of
    gigabytes."""
    base = _base_sizes(ws)
    w = len(ws)

    def size(node: Any) -> int:
        if not isinstance(node, dict) or not node:
            return base["any"]
        if "anyOf" in node:
            return sum(size(b) + 3 for b in node["anyOf"]) + 2
        if "properties" in node:
            parts = [len(k) + 8 + 3 * w + size(v) for k, v in node["properties"].items()]
            if node.get("required"):
                return sum(p + w + 4 for p in parts) + 4 + w
            total, prefix = 0, 0
            for p in parts:
                total += prefix + p + 2
                prefix += p + w + 4
            return total + 8 + w
        if "prefixItems" in node:
            return sum(size(i) + 2 * w + 1 for i in node["prefixItems"]) + 6 + 2 * w
        if "enum" in node:
            return sum(2 * len(json.dumps(v)) + 1 for v in node["enum"]) + 2
        kinds = node.get("type")
        total = 0
        for kind in [kinds] if isinstance(kinds, str) else kinds or []:
            if kind == "string":
                pattern = node.get("pattern")
                total += (
                    len(pattern) + 6 if pattern else base.get(node.get("format"), base["string"])
                )
            elif kind in ("number", "integer"):
                total += base[kind]
            elif kind in ("array", "object") and 0 in (
                node.get("maxItems"),
                node.get("maxProperties"),
            ):
                total += 6 + w
            elif kind == "array":
                items = node.get("items")
                total += 2 * size(items) + 30 + 3 * w if items is not None else base["array"]
            elif kind == "object":
                extra = node.get("additionalProperties")
                if extra is None:
                    total += base["object"]
                else:
                    total += 2 * (size(extra) + base["string"]) + 30 + 6 * w
            else:
                total += 12
        return total + 4

    return size(schema)


DEFAULT_MAX_REGEX_CHARS = 1 << 20
"""Refuse schemas whose regex would be longer (outlines would spend seconds and gigabytes
writing it before the DFA size check could even run)."""


@lru_cache(maxsize=256)
def _spec_regex(kind: str, spec_text: str, options: tuple[Any, ...], allow_unenforced: bool) -> str:
    whitespace, max_ws, disable_additional = options
    ws = whitespace_pattern(whitespace, max_ws)
    if kind == "regex":
        return _strip_anchors(spec_text)
    if kind == "choice":
        return choice_regex(json.loads(spec_text))
    if kind == "json_object":
        return build_regex_from_schema('{"type": "object"}', ws)
    if kind == "json":
        prepared = prepare_schema(json.loads(spec_text), disable_additional)
        if prepared.error is not None:
            raise GrammarError(f"outlines-core cannot take this schema: {prepared.error}")
        if prepared.unenforced and not allow_unenforced:
            raise GrammarError(
                "outlines-core would not enforce these schema keywords: "
                + ", ".join(prepared.unenforced)
                + " (set allow_unenforced to accept the schema with them ignored)"
            )
        chars = predict_regex_chars(prepared.schema, ws)
        if chars > DEFAULT_MAX_REGEX_CHARS:
            raise GrammarError(
                f"outlines-core would write a regex of about {chars} characters for this schema "
                f"(limit {DEFAULT_MAX_REGEX_CHARS}); use the xgrammar backend"
            )
        try:
            return build_regex_from_schema(json.dumps(prepared.schema), ws)
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
