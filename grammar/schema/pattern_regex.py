"""JSON-schema ``pattern`` (ECMA-262) to Rust-regex translation for outlines-core, and the
regex helpers of the outlines backend: literals, choices, anchors, a DFA-size estimate.

A schema pattern is searched in the decoded string; outlines matches regexes against the JSON
text between the quotes, so ``json_string_pattern`` writes the pattern at that level.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from baton.grammar.backend import GrammarError

# One character of JSON string text, no escapes: escapes inside a counted repetition make the
# outlines index build exponential in the count, so bounded strings are produced unescaped.
SAFE_CHAR = r'[^"\\\x00-\x1F]'
SAFE_ANY = rf"(?:{SAFE_CHAR}|\\[\"\\/bfnrt])"
_SAFE_SET = r'[^"\\\x00-\x1F]'
_JSON_SHORT_ESCAPES = {"\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
_ECMA_SPACE = r"[ \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}]"


class Unsupported(Exception):
    """A schema or pattern outlines cannot represent (never merely unenforced)."""


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


def strip_anchors(regex: str) -> str:
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
        raise Unsupported("empty character classes ([] or [^]) are not supported")
    items: list[str] = []
    safe = not negated  # every member is a character JSON writes unescaped
    while True:
        if j >= len(pattern):
            raise Unsupported("unterminated character class")
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
                    raise Unsupported(value or "bad escape")
            assert value is not None
            lo_item = _class_item(kind, value)
            lo_char = value if kind == "char" else None
            safe = safe and (lo_char is not None or value in _ASCII_CLASSES)
        elif ch == "[" and pattern.startswith("[:", j):
            end = pattern.find(":]", j)
            if end < 0:
                raise Unsupported("unterminated [: :] class")
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
                    raise Unsupported("a class range must end with a character")
                hi_char = value
            else:
                hi_char, k = pattern[j + 1], j + 2
            if ord(hi_char) < ord(lo_char):
                raise Unsupported(f"class range out of order: {lo_char!r}-{hi_char!r}")
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
            free = f"{SAFE_ANY}*"  # escapes are cheap outside counted repetitions
            branches.append(
                ("" if anchored_start else free) + f"(?:{body})" + ("" if anchored_end else free)
            )
        return "(?:" + "|".join(branches) + ")"
    except Unsupported as exc:
        raise GrammarError(f"pattern {pattern!r}: {exc}") from None


def _pattern_body(body: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            kind, value, i = _read_escape(body, i)
            if kind == "error":
                raise Unsupported(value or "bad escape")
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
            raise Unsupported("anchors (^, $) are supported only at the ends of the pattern")
        elif ch == "(":
            if body.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                raise Unsupported("lookaround assertions are not supported")
            if body.startswith("(?<", i) or body.startswith("(?P<", i):
                end = body.find(">", i)
                if end < 0:
                    raise Unsupported("unterminated group name")
                out.append("(?:")
                i = end + 1
            elif body.startswith("(?:", i):
                out.append("(?:")
                i += 3
            elif body.startswith("(?", i):
                raise Unsupported("inline flags and other (?...) groups are not supported")
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


__all__ = [
    "SAFE_ANY",
    "SAFE_CHAR",
    "Unsupported",
    "choice_regex",
    "estimate_dfa_states",
    "json_string_pattern",
    "regex_literal",
    "strip_anchors",
]
