"""Regex helpers of the outlines backend (the top-level split serves xgrammar's normal form
too, and ``may_search`` both backends' checks of patternProperties against declared names):
literals, choices, anchors, a DFA-size estimate, and
the JSON-schema ``pattern`` (ECMA-262) as the Rust regex outlines-core matches against the text
between a JSON string's quotes (``outlines_pattern``), where that can be said exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

# What outlines-core itself writes for free string text, and ECMA's "." in the JSON text (no
# character JSON escapes, no line terminator).
FREE_TEXT = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*'
_DOT = r'[^"\\\x00-\x1F\x{2028}\x{2029}]'
_JSON_RAW = r'[^"\\\x00-\x1F]'
_CONTROL_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v"}
_CLASS_ESCAPES = {"d": "0-9", "w": "0-9A-Za-z_"}  # ASCII, as ECMA-262 reads them
_QUANTIFIER = re.compile(r"\{\d+(?:,\d*)?\}")


class PatternRefused(Exception):
    """A pattern construct that outlines-core cannot be handed exactly (the message names it)."""


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


def may_search(pattern: str, text: str) -> bool:
    """Whether the ECMA ``pattern`` may match inside ``text`` (Python's ``re`` as the
    approximation; a pattern it cannot read counts as matching, the cautious answer)."""
    try:
        return re.search(pattern, text) is not None
    except (re.error, TypeError):
        return True


def outside_classes(pattern: str) -> Iterator[int]:
    """The indexes of ``pattern``'s characters that are regex syntax or literals outside a
    character class: escapes (the backslash and its character), classes and their brackets
    are skipped."""
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            i += 2 if pattern.startswith("[^", i) else 1
            continue
        else:
            yield i
        i += 1


def split_top_level(pattern: str) -> list[str]:
    """Splits a pattern at its top-level ``|``."""
    parts, depth, start = [], 0, 0
    for i in outside_classes(pattern):
        ch = pattern[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    parts.append(pattern[start:])
    return parts


def _literal(ch: str, negated: bool = False) -> str:
    """One pattern character as a literal in the JSON text (in a negated class, where it
    excludes, any character will do)."""
    if not negated and (ch in '"\\' or ord(ch) < 0x20):
        raise PatternRefused("it matches a quote, backslash or control character")
    return regex_literal(ch)


def _escape(
    pattern: str, i: int, in_class: bool, negated: bool = False
) -> tuple[str, str | None, int]:
    """The escape at ``pattern[i] == "\\"``: (Rust text, the character it stands for or None
    for a class, next index)."""
    ch = pattern[i + 1 : i + 2]
    if ch in _CLASS_ESCAPES and ch:
        inner = _CLASS_ESCAPES[ch]
        return (inner if in_class else f"[{inner}]"), None, i + 2
    j = i + 2
    width = {"x": 2, "u": 4}.get(ch, 0)
    if ch in _CONTROL_ESCAPES and ch:
        ch = _CONTROL_ESCAPES[ch]
    elif width and re.fullmatch(f"[0-9a-fA-F]{{{width}}}", pattern[j : j + width]):
        ch, j = chr(int(pattern[j : j + width], 16)), j + width
        if 0xD800 <= ord(ch) < 0xE000:
            raise PatternRefused("surrogate escapes are not supported")
    elif not ch or ch.isalnum() or not ch.isascii():
        raise PatternRefused(f"escape \\{ch} is not supported")
    return _literal(ch, negated), ch, j


def _class(pattern: str, i: int) -> tuple[str, int]:
    """The bracket class at ``pattern[i] == "["`` and the next index, less the characters JSON
    escapes (which a string's text never holds raw)."""
    j = i + 1
    negated = pattern.startswith("^", j)
    j += negated
    items: list[str] = []
    first, safe = j, not negated  # safe: no member is a character JSON escapes
    while True:
        if j >= len(pattern):
            raise PatternRefused("unterminated character class")
        ch = pattern[j]
        if ch == "]":
            if j == first:
                raise PatternRefused("empty character class")
            break
        if ch == "\\":
            text, lo, j = _escape(pattern, j, True, True)
        else:
            text, lo, j = _literal(ch, True), ch, j + 1
        if lo is not None and pattern.startswith("-", j) and pattern[j + 1 : j + 2] not in "]":
            hi: str | None = pattern[j + 1]
            if hi == "\\":
                hi_text, hi, j = _escape(pattern, j + 1, True, True)
            else:
                hi_text, j = _literal(pattern[j + 1], True), j + 2
            if hi is None or ord(hi) < ord(lo):
                raise PatternRefused("a class range must run upwards between two characters")
            text = f"{text}-{hi_text}"
            safe = safe and not (ord(lo) <= 0x22 <= ord(hi) or ord(lo) <= 0x5C <= ord(hi))
        if lo is not None:
            safe = safe and lo not in '"\\' and ord(lo) >= 0x20
        items.append(text)
    inner = "".join(items)
    if safe:
        return f"[{inner}]", j + 1
    return f"[[{'^' if negated else ''}{inner}]&&{_JSON_RAW}]", j + 1


def _body(pattern: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            text, _, i = _escape(pattern, i, False)
        elif ch == "[":
            text, i = _class(pattern, i)
        elif ch == ".":
            text, i = _DOT, i + 1
        elif ch in "^$":
            raise PatternRefused("an anchor inside the pattern")
        elif ch == "(":
            if pattern.startswith("(?:", i):
                text, i = "(?:", i + 3
            elif pattern.startswith("(?", i):
                raise PatternRefused("lookaround and other (?...) groups are not supported")
            else:
                text, i = "(", i + 1
        elif ch in "*+?)|":
            text, i = ch, i + 1
        elif ch == "{" and (m := _QUANTIFIER.match(pattern, i)):
            text, i = m.group(), m.end()
        else:
            text, i = _literal(ch), i + 1
        out.append(text)
    return "".join(out)


def outlines_pattern(pattern: str) -> str:
    """A JSON-schema ``pattern`` as outlines-core takes it (``^...$``, which it unwraps) for the
    text between a JSON string's quotes: a search in the decoded string, so an unanchored side
    gets free text; ``\\d``, ``\\w`` and ``.`` mean what they mean in ECMA-262 (Rust reads
    ``\\d``, ``\\w`` as Unicode classes); literals are written as Rust literals. What it writes
    can only match characters JSON writes unescaped; a pattern needing anything else is refused.

    Raises:
        PatternRefused: lookaround, backreferences, \\s, \\b, \\p, hex escapes, an inner
            anchor, or a literal quote, backslash or control character.
    """
    branches = []
    for branch in split_top_level(pattern):
        start = branch.startswith("^")
        branch = branch[1:] if start else branch
        end = False
        if branch.endswith("$") and (len(branch) - 1 - len(branch[:-1].rstrip("\\"))) % 2 == 0:
            end, branch = True, branch[:-1]
        body = _body(branch)
        branches.append(("" if start else FREE_TEXT) + f"(?:{body})" + ("" if end else FREE_TEXT))
    return "^(?:" + "|".join(branches) + ")$"


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
    "outside_classes",
    "FREE_TEXT",
    "PatternRefused",
    "choice_regex",
    "estimate_dfa_states",
    "may_search",
    "outlines_pattern",
    "regex_literal",
    "split_top_level",
    "strip_anchors",
]
