"""Schema algebra: the conjunction of two schemas as one (an allOf merged, siblings pushed into
branches), and whether a merge keeps what unevaluatedProperties/unevaluatedItems mean."""

from __future__ import annotations

from typing import Any

from baton.grammar.schema.types import ASSERTIONS, canon, type_intersection


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


def merge_schemas(
    a: dict[str, Any], b: dict[str, Any], keep_one: frozenset[str]
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


__all__ = ["cousins_ok", "merge_schemas"]
