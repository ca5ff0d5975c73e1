"""Objects' optional properties rebuilt so that a mask fill does not walk them one by one.

xgrammar (0.2.9) writes the properties after property k of an object as a chain of rules::

    obj_part_k ::= ((obj_part_k+1) | ("," "\\"key\\"" ":" value obj_part_k+1))

An optional property is skipped through the unit alternative ``(obj_part_k+1)``, so every
property after k is reachable only through every rule between. Inside a string value,
the tokens that close the string and go on (``",``, ``"}``, ``","``) are checked at fill time,
and each check walks that chain: the fill grew linearly with the properties left, 300 us
per row inside the first of 80 optional properties and 570 us at 150 (8 us in the last one).

The same language written with the separator factored out and every reachable property a
direct alternative fills in ~7 us whatever the count::

    obj_part_k ::= (("," obj_next_k) | "")
    obj_next_k ::= (("\\"key_k+1\\"" ":" value obj_part_k+1) | ("\\"key_k+2\\"" ...) | ...)

Written out in full that is quadratic in the property count (25 MB and 0.5 s of compile at
150 properties), so properties are grouped in blocks of ``BLOCK`` and the ones past k's block
are reached through one rule per later block: each list of alternatives stays within
``BLOCK`` plus the number of blocks, and no chain is longer than two unit rules.

A required property ends the reach (nothing after it may come before it), a tail of
additional properties (``obj_part_m ::= ((obj_additional_properties{0, -1}))``) is reached
exactly where xgrammar's chain reaches it. An object whose rules have any other shape is left
as xgrammar wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK = 16
"""Properties per block. Measured at 300 optional properties, fill per row inside the first
one: 47 us at 8, 36 at 12, 23 at 16 (1,590 us as xgrammar writes it); compiled size 2.3, 2.7
and 3.1 MB (1.1 MB unrewritten)."""

_PART_NAME = re.compile(r"^(?P<obj>\S+)_part_(?P<k>\d+)$")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\{\d+, -?\d+\}|[()|]|[^\s"(){}|]+')
_EMPTY = '""'


@dataclass(frozen=True)
class _Entry:
    """The property ``obj_part_k`` introduces: its separator, key-to-value text, whether
    it is required, and the part rule after it (None for the last declared property)."""

    separator: tuple[str, ...]
    body: tuple[str, ...]
    required: bool
    next_part: str | None


def _alternatives(body: str) -> list[list[str]] | None:
    """The rule body's alternatives as element lists (``[]`` for ``""``), or None when the
    body is not a flat choice of sequences."""
    tokens = _TOKEN.findall(body)
    if _TOKEN.sub("", body).strip():
        return None
    out: list[list[str]] = []
    i = 0
    if not tokens or tokens[0] != "(" or tokens[-1] != ")":
        return None
    inner = tokens[1:-1]
    while i < len(inner):
        if inner[i] == _EMPTY:
            out.append([])
            i += 1
        elif inner[i] == "(":
            j = i + 1
            elems: list[str] = []
            while j < len(inner) and inner[j] != ")":
                if inner[j] in ("(", "|"):
                    return None
                if inner[j].startswith("{"):
                    if not elems:
                        return None
                    elems[-1] += inner[j]
                else:
                    elems.append(inner[j])
                j += 1
            if j == len(inner):
                return None
            out.append(elems)
            i = j + 1
        else:
            return None
        if i < len(inner):
            if inner[i] != "|":
                return None
            i += 1
    return out


def _split_property(elems: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(separator, key-to-value) of ``SEP.. "\\"key\\"" COLON.. value``: the key is the first
    element that is a quoted key literal."""
    for i, e in enumerate(elems):
        if e.startswith('"\\"'):
            if i == 0:
                return None
            return tuple(elems[:i]), tuple(elems[i:])
    return None


def _entry(name: str, body: str, next_name: str, has_next: bool) -> _Entry | str | None:
    """The entry ``name`` introduces, the tail's repeat element (a str) when the rule is
    ``((X{0, -1}))``, or None for any other shape."""
    alts = _alternatives(body)
    if alts is None:
        return None
    if len(alts) == 1 and len(alts[0]) == 1 and alts[0][0].endswith("{0, -1}"):
        return None if has_next else alts[0][0]
    if has_next:
        if len(alts) == 2 and alts[0] == [next_name] and alts[1][-1:] == [next_name]:
            split = _split_property(alts[1][:-1])
            return None if split is None else _Entry(*split, False, next_name)
        if len(alts) == 1 and alts[0][-1:] == [next_name]:
            split = _split_property(alts[0][:-1])
            return None if split is None else _Entry(*split, True, next_name)
        return None
    if len(alts) == 2 and alts[0] == []:
        split = _split_property(alts[1])
        return None if split is None else _Entry(*split, False, None)
    if len(alts) == 1:
        split = _split_property(alts[0])
        return None if split is None else _Entry(*split, True, None)
    return None


def _seq(elems: Sequence[str]) -> str:
    return "(" + " ".join(elems) + ")"


def _choice(alts: Sequence[str]) -> str:
    return "(" + " | ".join(alts) + ")"


def _object_rules(
    obj: str, parts: list[str], rules: dict[str, str], taken: set[str]
) -> dict[str, str] | None:
    """The replacement and new rules for the object ``obj`` whose part rules are ``parts``
    (in order), or None when they are not all of the shapes this module rebuilds or a new
    rule's name is in ``rules`` or ``taken``."""
    entries: list[_Entry] = []
    tail: str | None = None
    for k, name in enumerate(parts):
        has_next = k + 1 < len(parts)
        next_name = parts[k + 1] if has_next else ""
        got = _entry(name, rules[name], next_name, has_next)
        if got is None:
            return None
        if isinstance(got, str):
            tail = name
        else:
            entries.append(got)
    n = len(entries)
    if n < 2 or len({e.separator for e in entries}) != 1:
        return None
    if not any(not e.required and e.next_part is not None for e in entries):
        return None
    separator = entries[0].separator
    names = {
        "next": [f"{obj}_part_{k}_next" for k in range(n)],
        "block": [f"{obj}_part_block_{b}" for b in range((n + BLOCK - 1) // BLOCK)],
        "after": [f"{obj}_part_after_{b}" for b in range((n + BLOCK - 1) // BLOCK)],
    }
    if any(x in rules or x in taken for group in names.values() for x in group):
        return None

    def alternative(j: int) -> str:
        e = entries[j]
        return _seq([*e.body, e.next_part] if e.next_part else e.body)

    def reach_in_block(start: int) -> tuple[list[str], bool]:
        """Alternatives from ``start`` to the end of its block or its first required
        entry; True when the block ends with none required (the reach goes on)."""
        end = min((start // BLOCK + 1) * BLOCK, n)
        alts = []
        for j in range(start, end):
            alts.append(alternative(j))
            if entries[j].required:
                return alts, False
        return alts, end < n

    out: dict[str, str] = {}
    blocks = len(names["block"])
    block_open = [
        not any(e.required for e in entries[b * BLOCK : (b + 1) * BLOCK]) for b in range(blocks)
    ]
    used_after: set[int] = set()
    for k in range(n):
        alts, goes_on = reach_in_block(k)
        if goes_on:
            used_after.add(k // BLOCK)
            alts.append(_seq([names["after"][k // BLOCK]]))
        out[names["next"][k]] = _choice(alts)
        choice = [_seq([*separator, names["next"][k]])]
        if not any(e.required for e in entries[k:]):
            choice.append(_seq([tail]) if tail is not None else _EMPTY)
        out[parts[k]] = _choice(choice)
    used_blocks: set[int] = set()
    for b in sorted(used_after):
        after = []
        for c in range(b + 1, blocks):
            used_blocks.add(c)
            after.append(_seq([names["block"][c]]))
            if not block_open[c]:
                break
        out[names["after"][b]] = _choice(after)
    for c in sorted(used_blocks):
        out[names["block"][c]] = _choice(reach_in_block(c * BLOCK)[0])
    return out


def rewrite_property_chains(text: str) -> str:
    """``text`` (xgrammar's EBNF of a JSON schema) with each object's chain of optional
    properties rebuilt as blocks of direct alternatives (see the module docstring); objects
    of any other shape, and everything else, unchanged."""
    lines = text.split("\n")
    rules: dict[str, str] = {}
    index: dict[str, int] = {}
    objects: dict[str, dict[int, str]] = {}
    for i, line in enumerate(lines):
        name, sep, body = line.partition(" ::= ")
        if not sep:
            continue
        rules[name] = body
        index[name] = i
        m = _PART_NAME.match(name)
        if m:
            objects.setdefault(m["obj"], {})[int(m["k"])] = name
    added: list[str] = []
    taken: set[str] = set()
    for obj, numbered in objects.items():
        if sorted(numbered) != list(range(len(numbered))):
            continue
        parts = [numbered[k] for k in range(len(numbered))]
        new = _object_rules(obj, parts, rules, taken)
        if new is None:
            continue
        for name, body in new.items():
            if name in index:
                lines[index[name]] = f"{name} ::= {body}"
            else:
                taken.add(name)
                added.append(f"{name} ::= {body}")
    return "\n".join(lines + added) if added else text


__all__ = ["BLOCK", "rewrite_property_chains"]
