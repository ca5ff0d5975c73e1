"""The rewrites baton applies to the EBNF that xgrammar (0.2.9) writes for a JSON schema.

xgrammar precomputes, for each position of each grammar rule, which tokens are accepted or
rejected there whatever the context; only the remaining ("uncertain") tokens are checked at
run time, one parse each. A rule shape that leaves thousands of tokens uncertain turns a
mask fill of microseconds into milliseconds per row. Each rewrite here keeps the language
(or narrows it to valid JSON), and each was measured on the shared schemas with ``baton bench
masks``; ``tests/grammar/test_grammar_fill_speed.py`` guards the speed and
``tests/grammar/test_grammar_xgrammar_rewrites.py`` the languages.

1. Length-bounded strings. xgrammar spells one character of a ``minLength``/``maxLength``
   string as ``[^"\\\\\\r\\n]``, which admits raw control characters (invalid JSON: seen in a
   soak run). It becomes ``[^\\0-\\x1f"\\\\]``: anything but a control character, '"' or a
   backslash, so a bounded string holds no escape sequence (xgrammar's class held none
   either). The bounds stay exact: one class match is one code point, as JSON Schema counts.
   Escapes are left out on purpose: a repeated alternation (plain character | escape) is a
   rule xgrammar cannot precompute masks for; it measured 20 ms per row per fill inside such
   a string instead of ~7 us. Unrolling the bound into one rule per position fills as fast but
   costs ~12 ms of compile per position.

2. The escape of unbounded strings. xgrammar's string rule reads ``"\\\\" basic_escape
   basic_string_sub``: after a backslash the matcher stands inside ``basic_escape``, where
   every token that goes on past the escape (``n  description: ...``) is uncertain. Inside an
   object with many optional properties that state measured 0.7-1.5 ms per row. With the
   escape's two forms written out in ``basic_string_sub`` itself (``"\\\\" [\\"\\\\/bfnrt]
   basic_string_sub | "\\\\u" hex hex hex hex basic_string_sub``) the same state fills in
   25-75 us, for about 1% more compiled-grammar memory.

3. Patterns that count a repetition past 128: rebuilt as grammar rules, see
   ``grammar/xgrammar/patterns.py`` (10-19 ms per row inside such a string before).

4. An object's optional properties: xgrammar chains them one rule per property, and every
   fill inside a value walked the chain of the properties after it (600 us per row inside the
   first of 150 optional properties); rebuilt as blocks of direct alternatives, see
   ``grammar/xgrammar/objects.py`` (~10-25 us whatever the count).

5. A root rule that the grammar refers to (a schema's ``{"$ref": "#"}``, a recursive EBNF
   ``root``). xgrammar precomputes the root rule's masks as if nothing could follow it: a token
   that runs past the rule's end is rejected there, also where the rule is a nested copy of
   itself. Its mask then refused tokens its matcher accepts (``}}``, ``},``, ``}]`` closing a
   nested object: 8 on the SchemaStore schemas jdt, jsone and unist), so a valid output could
   be cut off. The rule is renamed (``root_self``) wherever it appears and a new ``root`` refers
   to it once: the nested copies are then an ordinary rule, whose tokens past its end are
   checked at run time.

6. Surrogates. xgrammar reads a negated character class (``[^"\\...]``, every JSON string
   character) as any code point not listed, surrogates U+D800-U+DFFF included, and spells them
   in UTF-8 (``ED A0..BF xx``): bytes no UTF-8 decoder accepts, so a string that counted 8
   characters in the grammar decoded to 10 (seen: a maxLength 8 name came out as
   ``' rem ?\u07b8\ufffd\ufffd\ufffd'``, test_reasoning.py at temperature 1). Every
   negated class of the EBNF gets ``\ud800-\udfff`` added to what it excludes. Patterns
   (``Regex(...)``) are xgrammar's own regex reading and keep its behaviour.
"""

from __future__ import annotations

import re

from baton.grammar.xgrammar.objects import rewrite_property_chains
from baton.grammar.xgrammar.patterns import rewrite_counted_patterns

BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
"""xgrammar's character of a length-bounded string, as it prints it."""

PLAIN_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'
"""What baton puts in its place: no control character, no quote, no backslash."""

_ESCAPE_ALTERNATIVE = '("\\\\" basic_escape basic_string_sub)'
_INLINE_ESCAPE = (
    '("\\\\" [\\"\\\\/bfnrt] basic_string_sub) | '
    '("\\\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] basic_string_sub)'
)
# The escape alternative only where it is a whole alternative of the rule's choice: after
# "(" opening the choice or "| ", and before ")" closing it or " |".
_ESCAPE_IN_CHOICE = re.compile(
    r"(?:(?<=\()|(?<=\| ))" + re.escape(_ESCAPE_ALTERNATIVE) + r"(?=\)| \|)"
)
_STRING_SUB_RULE = "basic_string_sub ::= "

# The pieces of an EBNF rule body: a string literal, a character class, a rule name, or
# anything else (one character). Names are matched whole: "root" is not part of "root_1".
_EBNF_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][\w.\-]*|.', re.S)
_RULE_HEAD = re.compile(r"^([A-Za-z_][\w.\-]*) ::= ", re.M)


def _renamed(body: str, old: str, new: str) -> str:
    """``body`` (EBNF after a rule's ``::=``) with every reference to rule ``old`` as ``new``;
    string literals and character classes are left as they are."""
    return "".join(new if m.group() == old else m.group() for m in _EBNF_PIECE.finditer(body))


def unshare_root(text: str, root: str = "root") -> str:
    """``text`` (EBNF as xgrammar prints it, one rule a line) with a rule ``root`` that other
    rules (or itself) refer to renamed, and a new ``root`` that refers to it once (rewrite 5
    above); unchanged when no rule refers to ``root``."""
    lines = text.split("\n")
    heads = [_RULE_HEAD.match(line) for line in lines]
    names = {m.group(1) for m in heads if m}
    if root not in names:
        return text
    referred = any(
        m is not None and any(p.group() == root for p in _EBNF_PIECE.finditer(line[m.end() :]))
        for line, m in zip(lines, heads, strict=True)
    )
    if not referred:
        return text
    new = root + "_self"
    while new in names:
        new += "_"
    out = []
    for line, m in zip(lines, heads, strict=True):
        if m is None:
            out.append(line)
            continue
        name = new if m.group(1) == root else m.group(1)
        out.append(f"{name} ::= {_renamed(line[m.end() :], root, new)}")
    out.append(f"{root} ::= (({new}))")
    return "\n".join(out)


SURROGATES = "\\uD800-\\uDFFF"
"""The range every negated character class also excludes (rewrite 6), as EBNF spells it."""


def exclude_surrogates(text: str) -> str:
    """``text`` (EBNF) with ``SURROGATES`` added to every negated character class (rewrite 6);
    string literals (``Regex`` patterns too) and other classes are left as they are."""
    out = []
    for line in text.split("\n"):
        if "[^" not in line:
            out.append(line)
            continue
        pieces = (m.group() for m in _EBNF_PIECE.finditer(line))
        out.append(
            "".join(
                p[:-1] + SURROGATES + "]" if p.startswith("[^") and SURROGATES not in p else p
                for p in pieces
            )
        )
    return "\n".join(out)


def rewrite_json_ebnf(text: str) -> str:
    """``text`` (xgrammar's EBNF of a JSON schema, from ``str(Grammar)``) with baton's
    rewrites applied; unchanged when it has none of the shapes they rewrite."""
    text = unshare_root(text)
    text = rewrite_counted_patterns(text)
    text = rewrite_property_chains(text)
    text = text.replace(BOUNDED_STRING_CHAR, PLAIN_STRING_CHAR)
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(_STRING_SUB_RULE):
            lines[i] = _ESCAPE_IN_CHOICE.sub(lambda _: _INLINE_ESCAPE, line)
    return exclude_surrogates("\n".join(lines))


__all__ = [
    "BOUNDED_STRING_CHAR",
    "PLAIN_STRING_CHAR",
    "SURROGATES",
    "exclude_surrogates",
    "rewrite_json_ebnf",
    "unshare_root",
]
