"""Which schema features a grammar state stands inside, for ``baton bench masks``.

A JSON instance is serialised as the grammar expects it while its schema is walked beside
it, so that every byte of the text carries the feature families of the schema nodes that
enclose it (its own value's node and every ancestor's). A matcher that has accepted the first
``k`` bytes stands before byte ``k``: its state belongs to that byte's families.

Families (a state may be in several, or in none: "plain"):

* ``bounded strings``: inside a string whose schema has ``minLength``/``maxLength``;
* ``patterns``: inside a string with ``pattern``;
* ``formats``: inside a string with ``format``;
* ``enums and consts``: inside a value whose schema has ``enum`` or ``const``;
* ``nested objects``: inside an object that is itself inside an object;
* ``array bounds``: inside an array with ``minItems``/``maxItems``;
* ``anyOf/oneOf``: inside a value whose schema has ``anyOf`` or ``oneOf``;
* ``deep $ref``: inside a value whose schema was reached through two or more ``$ref`` hops.

Nothing here imports a grammar backend: it reads schemas and instances only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

FAMILIES: tuple[str, ...] = (
    "bounded strings",
    "patterns",
    "formats",
    "enums and consts",
    "nested objects",
    "array bounds",
    "anyOf/oneOf",
    "deep $ref",
)
PLAIN = "plain"
"""The family of a state inside none of ``FAMILIES``."""

DEEP_REF_HOPS = 2
_MAX_REF_HOPS = 64  # a $ref cycle without progress ends here


@dataclass(frozen=True)
class _Node:
    """One schema node that applies to a value, and how many $ref hops led to it."""

    schema: Any  # a dict when it applies; anything else is skipped
    hops: int


class _Labeler:
    """Serialises an instance beside its schema, collecting (text, families) pieces."""

    def __init__(self, root: Any, separators: tuple[str, str]) -> None:
        self.root = root
        self.item_sep, self.key_sep = separators
        self.pieces: list[tuple[str, frozenset[str]]] = []
        self._validator: Any = None
        try:
            cls = jsonschema.validators.validator_for(root) if isinstance(root, dict) else None
            self._validator = cls(root) if cls is not None else None
        except (jsonschema.SchemaError, TypeError, ValueError):
            self._validator = None

    def _resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return None
        return node

    def _matches(self, branch: Any, data: Any) -> bool:
        if self._validator is None:
            return False
        try:
            return bool(self._validator.evolve(schema=branch).is_valid(data))
        except Exception:  # noqa: BLE001 - an unresolvable branch: not this one
            return False

    def expand(self, nodes: Sequence[_Node], data: Any) -> tuple[list[_Node], bool]:
        """The nodes that apply to ``data``: ``nodes``, their local ``$ref`` targets, ``allOf``
        members and, of each ``anyOf``/``oneOf``, the first branch ``data`` is valid under.
        Also returns whether an ``anyOf``/``oneOf`` was met."""
        out: list[_Node] = []
        alternative = False
        stack = list(reversed(nodes))
        seen: set[tuple[int, int]] = set()
        while stack:
            node = stack.pop()
            if not isinstance(node.schema, dict) or (id(node.schema), node.hops) in seen:
                continue
            seen.add((id(node.schema), node.hops))
            out.append(node)
            ref = node.schema.get("$ref")
            local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
            if local and node.hops < _MAX_REF_HOPS:
                stack.append(_Node(self._resolve(ref), node.hops + 1))
            members = node.schema.get("allOf")
            if isinstance(members, list):
                stack.extend(_Node(m, node.hops) for m in reversed(members))
            for key in ("anyOf", "oneOf"):
                branches = node.schema.get(key)
                if isinstance(branches, list):
                    alternative = True
                    chosen = next((b for b in branches if self._matches(b, data)), None)
                    if chosen is not None:
                        stack.append(_Node(chosen, node.hops))
        return out, alternative

    def families(
        self, nodes: Sequence[_Node], data: Any, alternative: bool, objects: int
    ) -> set[str]:
        """The families ``data``'s own nodes give it (``objects``: enclosing objects)."""
        found: set[str] = set()
        for node in nodes:
            s = node.schema
            if "enum" in s or "const" in s:
                found.add("enums and consts")
            if isinstance(data, str):
                if "pattern" in s:
                    found.add("patterns")
                if "format" in s:
                    found.add("formats")
                if "minLength" in s or "maxLength" in s:
                    found.add("bounded strings")
            elif isinstance(data, list) and ("minItems" in s or "maxItems" in s):
                found.add("array bounds")
            if node.hops >= DEEP_REF_HOPS:
                found.add("deep $ref")
        if isinstance(data, dict) and objects >= 1:
            found.add("nested objects")
        if alternative:
            found.add("anyOf/oneOf")
        return found

    @staticmethod
    def property_nodes(nodes: Sequence[_Node], key: str) -> list[_Node]:
        """The schema nodes of property ``key`` of an object under ``nodes``."""
        out: list[_Node] = []
        for node in nodes:
            s = node.schema
            props = s.get("properties")
            declared = isinstance(props, dict) and key in props
            if declared:
                out.append(_Node(props[key], node.hops))
            matched = False
            patterns = s.get("patternProperties")
            if isinstance(patterns, dict):
                for pattern, sub in patterns.items():
                    try:
                        hit = re.search(pattern, key) is not None
                    except re.error:
                        hit = False
                    if hit:
                        matched = True
                        out.append(_Node(sub, node.hops))
            extra = s.get("additionalProperties")
            if not declared and not matched and isinstance(extra, dict):
                out.append(_Node(extra, node.hops))
        return out

    @staticmethod
    def item_nodes(nodes: Sequence[_Node], index: int) -> list[_Node]:
        """The schema nodes of item ``index`` of an array under ``nodes``."""
        out: list[_Node] = []
        for node in nodes:
            s = node.schema
            prefix = s.get("prefixItems")
            items = s.get("items")
            if isinstance(prefix, list) and index < len(prefix):
                out.append(_Node(prefix[index], node.hops))
            elif isinstance(items, list):  # draft 4 tuples
                if index < len(items):
                    out.append(_Node(items[index], node.hops))
                elif isinstance(s.get("additionalItems"), dict):
                    out.append(_Node(s["additionalItems"], node.hops))
            elif isinstance(items, dict):
                out.append(_Node(items, node.hops))
        return out

    def key_order(self, nodes: Sequence[_Node]) -> list[str]:
        order: list[str] = []
        for node in nodes:
            props = node.schema.get("properties")
            if isinstance(props, dict):
                order += [k for k in props if k not in order]
        return order

    def value(self, nodes: Sequence[_Node], data: Any, outer: frozenset[str], objects: int) -> None:
        applied, alternative = self.expand(nodes, data)
        here = outer | self.families(applied, data, alternative, objects)
        if isinstance(data, dict):
            self.pieces.append(("{", here))
            for i, (key, item) in enumerate(data.items()):
                if i:
                    self.pieces.append((self.item_sep, here))
                self.pieces.append((json.dumps(key, ensure_ascii=False) + self.key_sep, here))
                self.value(self.property_nodes(applied, key), item, here, objects + 1)
            self.pieces.append(("}", here))
        elif isinstance(data, list):
            self.pieces.append(("[", here))
            for i, item in enumerate(data):
                if i:
                    self.pieces.append((self.item_sep, here))
                self.value(self.item_nodes(applied, i), item, here, objects)
            self.pieces.append(("]", here))
        else:
            self.pieces.append((json.dumps(data, ensure_ascii=False), here))

    def reorder(self, nodes: Sequence[_Node], data: Any) -> Any:
        applied, _ = self.expand(nodes, data)
        if isinstance(data, dict):
            rank = {k: i for i, k in enumerate(self.key_order(applied))}
            keys = sorted(data, key=lambda k: rank.get(k, len(rank)))
            return {k: self.reorder(self.property_nodes(applied, k), data[k]) for k in keys}
        if isinstance(data, list):
            return [self.reorder(self.item_nodes(applied, i), v) for i, v in enumerate(data)]
        return data


def _separators(whitespace: str) -> tuple[str, str]:
    return (",", ":") if whitespace == "compact" else (", ", ": ")


def in_schema_order(schema: Any, data: Any) -> Any:
    """``data`` with every object's keys in the order its schema declares them under
    ``properties`` (xgrammar and outlines generate properties in that order only); keys the
    schema does not declare go last, in their own order."""
    labeler = _Labeler(schema, _separators("compact"))
    return labeler.reorder([_Node(schema, 0)] if isinstance(schema, dict) else [], data)


def byte_families(schema: Any, data: Any, whitespace: str) -> tuple[bytes, list[frozenset[str]]]:
    """The instance serialised as ``json.dumps`` with the whitespace mode's separators (compact:
    ``(",", ":")``, any: ``(", ", ": ")``; ``ensure_ascii=False``), as UTF-8, and the families
    of each of its bytes.

    Raises:
        ValueError: the text differs from ``json.dumps``' (a value this walk does not serialise
            the same way, such as a non-string key).
    """
    separators = _separators(whitespace)
    labeler = _Labeler(schema, separators)
    labeler.value([_Node(schema, 0)] if isinstance(schema, dict) else [], data, frozenset(), 0)
    text = "".join(piece for piece, _ in labeler.pieces)
    expected = json.dumps(data, separators=separators, ensure_ascii=False)
    if text != expected:
        raise ValueError(f"cannot label this instance: serialised as {text[:80]!r}")
    raw = bytearray()
    families: list[frozenset[str]] = []
    for piece, fams in labeler.pieces:
        encoded = piece.encode("utf-8")
        raw += encoded
        families += [fams] * len(encoded)
    return bytes(raw), families


def state_families(
    schema: Any, data: Any, whitespace: str, token_lengths: Sequence[int]
) -> list[frozenset[str]]:
    """The families of each state of a walk over the instance's tokens: state ``i`` comes
    before token ``i`` (its families are those of the token's first byte); the last state,
    after every token (where EOS is filled), has the families of the instance's last byte.

    Raises:
        ValueError: as ``byte_families``, or the token lengths do not add up to the text.
    """
    raw, families = byte_families(schema, data, whitespace)
    if sum(token_lengths) != len(raw):
        raise ValueError(f"the tokens cover {sum(token_lengths)} bytes of {len(raw)}")
    out: list[frozenset[str]] = []
    offset = 0
    for length in token_lengths:
        out.append(families[offset])
        offset += length
    out.append(families[-1] if families else frozenset())
    return out


__all__ = [
    "DEEP_REF_HOPS",
    "FAMILIES",
    "PLAIN",
    "byte_families",
    "in_schema_order",
    "state_families",
]
