"""Provable disjointness of ``oneOf`` branches under JSON Schema's own semantics.

Backends build ``oneOf`` as ``anyOf``; that is exact only when no instance can match two
branches. ``branches_disjoint`` proves it cheaply, or answers False: branches whose JSON types
cannot overlap (an untyped branch may be of any type), whose ``const``/``enum`` values cannot
overlap, or object-only branches that require one property with non-overlapping
``const``/``enum`` values (a discriminator). Local ``$ref``s are followed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.grammar.schema.refs import is_local_ref, resolve_local_ref
from baton.grammar.schema.types import ALL_TYPES, OBJECT, canon, declared_types, value_types

_MAX_DEPTH = 16


@dataclass
class _Facts:
    """What every instance of a schema has in common (sound over-approximations)."""

    types: frozenset[str] = ALL_TYPES
    values: set[str] | None = None  # the only values allowed (canonical JSON), None: any
    discriminators: dict[str, set[str]] = field(default_factory=dict)


def _values(node: dict[str, Any]) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    enum = node.get("enum")
    return enum if isinstance(enum, list) else None


def _facts(node: Any, root: Any, depth: int) -> _Facts:
    if node is False:
        return _Facts(types=frozenset(), values=set())
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return _Facts()
    facts = _Facts()
    ref = node.get("$ref")
    if is_local_ref(ref):
        target = resolve_local_ref(root, ref)
        if target is not None:
            facts = _facts(target, root, depth + 1)
    if "type" in node:
        facts.types = facts.types & declared_types(node)
    values = _values(node)
    if values is not None:
        keys = {canon(v) for v in values}
        facts.values = keys if facts.values is None else facts.values & keys
        facts.types = facts.types & frozenset().union(*(value_types(v) for v in values))
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            union: frozenset[str] = frozenset()
            for branch in branches:
                union |= _facts(branch, root, depth + 1).types
            facts.types = facts.types & union
    members = node.get("allOf")
    if isinstance(members, list):
        for member in members:
            inner = _facts(member, root, depth + 1)
            facts.types = facts.types & inner.types
            facts.discriminators.update(inner.discriminators)
    required = node.get("required")
    properties = node.get("properties")
    if isinstance(required, list) and isinstance(properties, dict):
        for name in required:
            sub = properties.get(name) if isinstance(name, str) else None
            if isinstance(sub, dict) and is_local_ref(sub.get("$ref")):
                sub = resolve_local_ref(root, sub["$ref"])
            sub_values = _values(sub) if isinstance(sub, dict) else None
            if sub_values is not None:
                facts.discriminators[name] = {canon(v) for v in sub_values}
    return facts


def _apart(a: _Facts, b: _Facts) -> bool:
    if not (a.types & b.types):
        return True
    if a.values is not None and b.values is not None and not (a.values & b.values):
        return True
    if a.types <= OBJECT and b.types <= OBJECT:
        for name, mine in a.discriminators.items():
            theirs = b.discriminators.get(name)
            if theirs is not None and not (mine & theirs):
                return True
    return False


def branches_disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no instance can match two of ``branches``, provably (see the module docstring).

    Never raises on odd input: what it cannot read counts as "may overlap"."""
    facts = [_facts(b, root, 0) for b in branches]
    return all(_apart(facts[i], facts[j]) for i in range(len(facts)) for j in range(i))


__all__ = ["branches_disjoint"]
