"""Schema algebra behind outlines' rewriting (``outlines_prepare``): the conjunction of two
schemas (allOf, siblings pushed into branches), exact-value schemas, provable disjointness of
oneOf branches, and the any-value wrapper outlines' converter needs."""

from __future__ import annotations

import json
from typing import Any

from baton.grammar.schema.outlines_keywords import (
    OUTLINES_CONDITIONAL_KEYWORDS,
    OUTLINES_UNENFORCED_KEYWORDS,
)
from baton.grammar.schema.types import (
    ARRAY,
    ASSERTIONS,
    OBJECT,
    canon,
    declared_types,
    type_intersection,
    value_types,
)


def json_key(name: str) -> str:
    """A property name as it appears between the quotes in JSON text."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


ANY_WRAPPED: dict[str, Any] = {"anyOf": [{}]}


def wrap_any(node: Any, top: bool) -> Any:
    """Replaces nested ``{}`` by ``{"anyOf": [{}]}``: outlines writes the any-value regex as a
    bare alternation, which breaks the regex it is embedded in (``[{}]`` would match "[1,2,3").
    """
    if not isinstance(node, dict):
        return node
    if not node:
        return node if top else ANY_WRAPPED
    out = dict(node)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: wrap_any(v, False) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = wrap_any(out[key], False)
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [wrap_any(v, False) for v in out["prefixItems"]]
    if isinstance(out.get("anyOf"), list) and out is not ANY_WRAPPED and out["anyOf"] != [{}]:
        out["anyOf"] = [wrap_any(v, False) for v in out["anyOf"]]
    return out


def cousins_ok(parts: list[dict[str, Any]]) -> bool:
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


def const_schema(value: Any) -> dict[str, Any]:
    """A schema outlines turns into exactly ``value`` (key order as given)."""
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {json_key(k): const_schema(v) for k, v in value.items()},
            "required": [json_key(k) for k in value],
        }
    if isinstance(value, list):
        if not value:
            return {"type": "array", "maxItems": 0}
        return {"prefixItems": [const_schema(v) for v in value]}
    return {"enum": [value]}


_OUTLINES_KEEP_ONE = OUTLINES_UNENFORCED_KEYWORDS - frozenset(OUTLINES_CONDITIONAL_KEYWORDS)


def merge_schemas(
    a: dict[str, Any], b: dict[str, Any], keep_one: frozenset[str] = _OUTLINES_KEEP_ONE
) -> dict[str, Any] | None:
    """The conjunction of two schemas as one schema, or None when this merge cannot say it.

    ``keep_one``: keywords of which one copy may be kept when both sides differ (the backend
    reports them as unenforced wherever they appear, so which copy is kept does not matter).
    """
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
            continue
        mine = out[key]
        if canon(mine) == canon(value) or key not in ASSERTIONS:
            continue
        if key == "required":
            out[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "type":
            types = type_intersection(mine, value)
            if not types:
                return None
            out[key] = types
        elif key == "enum":
            keys = {canon(v) for v in value}
            out[key] = [v for v in mine if canon(v) in keys]
        elif key in ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"):
            out[key] = max(mine, value)
        elif key in ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"):
            out[key] = min(mine, value)
        elif key == "uniqueItems":
            out[key] = bool(mine or value)
        elif key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            props = dict(mine)
            for name, sub in value.items():
                if name in props and canon(props[name]) != canon(sub):
                    props[name] = {"allOf": [props[name], sub]}
                else:
                    props.setdefault(name, sub)
            out[key] = props
        elif key in ("items", "additionalProperties", "propertyNames") and all(
            isinstance(x, (dict, bool)) for x in (mine, value)
        ):
            out[key] = {"allOf": [mine, value]}
        elif key in keep_one:
            continue
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
        # items (draft 4-2019: additionalItems) applies past that side's own prefix only.
        rest = any(k in x and x[k] is not True for k in ("items", "additionalItems"))
        if rest and _prefix_length(y) > _prefix_length(x):
            return None
    return out


def _prefix_length(schema: dict[str, Any]) -> int:
    prefix = schema.get("prefixItems")
    if not isinstance(prefix, list):
        prefix = schema.get("items") if isinstance(schema.get("items"), list) else []
    return len(prefix)


def _signature(schema: Any) -> tuple[frozenset[str] | None, set[str] | None, dict[str, set[str]]]:
    """(types it can take, exact values, required-property discriminators) of a prepared branch."""
    if not isinstance(schema, dict) or not schema:
        return None, None, {}
    if "enum" in schema:
        values = schema["enum"]
        return (
            frozenset().union(*(value_types(v) for v in values)),
            {canon(v) for v in values},
            {},
        )
    if "properties" in schema:
        disc: dict[str, set[str]] = {}
        for name in schema.get("required", []):
            sub = schema["properties"].get(name)
            if isinstance(sub, dict) and "enum" in sub:
                disc[name] = {canon(v) for v in sub["enum"]}
        return OBJECT, None, disc
    if "prefixItems" in schema:
        return ARRAY, None, {}
    if "type" in schema:
        return declared_types(schema), None, {}
    return None, None, {}


def pairwise_disjoint(branches: list[Any]) -> bool:
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


__all__ = [
    "ANY_WRAPPED",
    "const_schema",
    "cousins_ok",
    "json_key",
    "merge_schemas",
    "pairwise_disjoint",
    "wrap_any",
]
