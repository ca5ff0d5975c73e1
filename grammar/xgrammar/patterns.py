"""Patterns with a counted repetition over 128, rebuilt as grammar rules xgrammar can cache.

xgrammar (0.2.9) writes a JSON-schema ``pattern`` as one ``Regex("...", json_string=true)``
rule, matched by an automaton. When the pattern counts a repetition past 128
(``[a-z.]{1,254}``, ``[^@]{1,255}``) that automaton's masks are not precomputed: every fill
inside such a string measured 10-19 ms per row, against 2-4 us at 128 and below. The same
pattern through ``Grammar.from_regex`` is ordinary rules with a ``{m, n}`` repetition of a
character class, which fills in microseconds like a length-bounded string.

So such a ``Regex`` rule is replaced by those rules, made to match JSON string text: each
character class keeps only plain characters (no control character, no '"', no backslash: the
same rule as length-bounded strings, so such a string holds no escape sequence), and each
literal character is written as JSON writes it (a literal '"' becomes ``\\"``). A pattern whose
rules would need a class emptied that way keeps xgrammar's automaton.
"""

from __future__ import annotations

import re

import xgrammar as xgr

MAX_FAST_COUNT = 128
"""The largest repetition count xgrammar's pattern automaton handles quickly (measured)."""

_MAX_CODE_POINT = 0x10FFFF
_DROPPED = "\0dropped"
_REGEX_RULE = re.compile(r'^(\w+) ::= Regex\("((?:[^"\\]|\\.)*)", json_string=true\)$')
_COUNT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
# Plain JSON string characters: everything but controls, '"' and the backslash.
_PLAIN_RANGES = [(0x20, 0x21), (0x23, 0x5B), (0x5D, _MAX_CODE_POINT)]
_JSON_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_JSON_SHORT |= {"\b": "\\b", "\f": "\\f"}


class _NoRewrite(Exception):
    """The rule keeps xgrammar's automaton (a shape this module does not rebuild)."""


def _read_escape(text: str, i: int) -> tuple[str, int]:
    """The character of the escape at ``text[i]`` (a backslash) and the index after it."""
    if i + 1 >= len(text):
        raise _NoRewrite("a trailing backslash")
    c = text[i + 1]
    widths = {"x": 2, "u": 4, "U": 8}
    if c in widths:
        digits = text[i + 2 : i + 2 + widths[c]]
        if len(digits) != widths[c]:
            raise _NoRewrite("a short escape")
        return chr(int(digits, 16)), i + 2 + widths[c]
    return _SIMPLE_ESCAPES.get(c, c), i + 2


def _unescape(text: str) -> str:
    """An EBNF string literal's body as the characters it stands for."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\":
            ch, i = _read_escape(text, i)
            out.append(ch)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _class_ranges(body: str) -> tuple[bool, list[tuple[int, int]]]:
    """(negated, code point ranges) of a printed character class's body (without brackets)."""
    negated = body.startswith("^")
    i = 1 if negated else 0
    ranges: list[tuple[int, int]] = []
    while i < len(body):
        if body[i] == "\\":
            lo, i = _read_escape(body, i)
        else:
            lo, i = body[i], i + 1
        hi = lo
        if i < len(body) and body[i] == "-" and i + 1 < len(body):
            if body[i + 1] == "\\":
                hi, i = _read_escape(body, i + 1)
            else:
                hi, i = body[i + 1], i + 2
        ranges.append((ord(lo), ord(hi)))
    return negated, ranges


def _normalise(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for lo, hi in _normalise(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODE_POINT:
        out.append((start, _MAX_CODE_POINT))
    return out


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo1, hi1 in _normalise(a):
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo <= hi:
                out.append((lo, hi))
    return _normalise(out)


def _class_char(code: int) -> str:
    ch = chr(code)
    if 0x21 <= code <= 0x7E and ch not in "\\]-^[":
        return ch
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def plain_class(body: str) -> str:
    """The printed character class ``[body]`` narrowed to plain JSON string characters, as a
    printed class.

    Raises:
        _NoRewrite: nothing would be left of the class.
    """
    negated, ranges = _class_ranges(body)
    if negated:
        ranges = _complement(ranges)
    kept = _intersect(ranges, _PLAIN_RANGES)
    if not kept:
        raise _NoRewrite("a class with no plain character")
    # xgrammar compiles a repetition of a negated class over all of Unicode much faster than
    # the same set as positive ranges up to U+10FFFF (15 ms against 6 s at {0,254}).
    dropped = _complement(kept)
    negate = kept[-1][1] == _MAX_CODE_POINT and len(dropped) <= len(kept) + 2
    shown = dropped if negate else kept
    items = [
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in shown
    ]
    return ("[^" if negate else "[") + "".join(items) + "]"


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


def json_literal(body: str) -> str:
    """The printed string literal ``"body"`` as the literal of its JSON string text."""
    return ebnf_string_literal(
        "".join(
            _JSON_SHORT.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 else ch)
            for ch in _unescape(body)
        )
    )


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\b[A-Za-z_]\w*\b|.', re.S)


def _regex_rules(name: str, pattern: str) -> list[str]:
    """The rules of ``pattern`` (``from_regex``) renamed under ``name`` and made JSON-safe."""
    try:
        text = str(xgr.Grammar.from_regex(pattern))
    except (RuntimeError, ValueError) as exc:
        raise _NoRewrite(f"xgrammar cannot convert it: {exc}") from None
    rules = []
    for line in text.strip().split("\n"):
        out = []
        for token in _TOKEN.findall(line):
            if token.startswith('"') and len(token) >= 2:
                out.append(json_literal(token[1:-1]))
            elif token.startswith("[") and token.endswith("]") and len(token) >= 2:
                out.append(plain_class(token[1:-1]))
            elif token == "root":
                out.append(name)
            elif token.startswith("root_"):
                out.append(name + "_rx" + token[4:])
            elif token.startswith(("Regex", "TagDispatch")):
                raise _NoRewrite(f"{token} inside the converted pattern")
            else:
                out.append(token)
        rules.append("".join(out))
    if not rules[0].startswith(f"{name} ::= "):
        raise _NoRewrite("an unexpected first rule")
    return rules


def _alternatives(body: str) -> list[str] | None:
    """The sequences of a rule body printed as ``((seq) | (seq) ...)``; None for another
    shape (a lookahead suffix, a bare element)."""
    if not (body.startswith("((") and body.endswith("))")):
        return None
    inner = body[1:-1]
    parts, depth, start = [], 0, 0
    tokens = _TOKEN.findall(inner)
    pos = 0
    for token in tokens:
        if token == "(":
            depth += 1
        elif token == ")":
            depth -= 1
        elif token == "|" and depth == 0:
            parts.append(inner[start:pos].strip())
            start = pos + 1
        pos += len(token)
    parts.append(inner[start:].strip())
    if any(not (p.startswith("(") and p.endswith(")")) for p in parts):
        return None
    return [p[1:-1] for p in parts]


def _inline_into_string(
    lines: list[str], name: str, rules: list[str]
) -> tuple[list[str], list[str]] | None:
    """``lines`` with the string rule ``P ::= (("\"" name "\""))`` taking ``name``'s
    alternatives between its quotes (a repetition directly before the closing quote compiles
    in milliseconds; one level down it took seconds), and ``rules`` but ``name``'s own added;
    None when there is no such single use of ``name``."""
    quoted = f'(("\\"" {name} "\\""))'
    users = [i for i, line in enumerate(lines) if re.search(rf"\b{re.escape(name)}\b", line)]
    if len(users) != 2:  # the string rule and the Regex rule itself
        return None
    parent = next((i for i in users if lines[i].endswith(" ::= " + quoted)), None)
    alternatives = _alternatives(rules[0][len(f"{name} ::= ") :])
    if parent is None or alternatives is None:
        return None
    head = lines[parent][: -len(quoted)]
    body = " | ".join(f'("\\"" {seq} "\\"")' for seq in alternatives)
    out = list(lines)
    out[parent] = f"{head}({body})"
    return out, rules[1:]


def _counts_past_fast(pattern: str) -> bool:
    for m in _COUNT.finditer(pattern):
        if int(m.group(1)) > MAX_FAST_COUNT:
            return True
        upper = m.group(2)
        if upper and int(upper) > MAX_FAST_COUNT:
            return True
    return False


def rewrite_counted_patterns(text: str) -> str:
    """``text`` (xgrammar's EBNF of a JSON schema) with every ``Regex(..., json_string=true)``
    rule whose pattern counts past ``MAX_FAST_COUNT`` replaced by equivalent grammar rules
    (narrowed to plain characters in its classes); other rules unchanged."""
    lines = text.split("\n")
    for index, line in enumerate(list(lines)):
        m = _REGEX_RULE.match(line)
        if m is None:
            continue
        name, literal = m.groups()
        try:
            pattern = _unescape(literal)
            if not _counts_past_fast(pattern):
                continue
            rules = _regex_rules(name, pattern)
        except _NoRewrite:
            continue
        inlined = _inline_into_string(lines, name, rules)
        if inlined is None:
            lines[index] = "\n".join(rules)
        else:
            lines, extra = inlined
            lines[index] = "\n".join(extra)  # may be empty: dropped below
            lines[index] = lines[index] or _DROPPED
    return "\n".join(line for line in lines if line is not _DROPPED)


__all__ = ["MAX_FAST_COUNT", "json_literal", "plain_class", "rewrite_counted_patterns"]
