"""JSON types in schemas: the types of values, of ``type`` keywords, and which instance types
each assertion keyword constrains (a keyword cannot be violated by a value of another type)."""

from __future__ import annotations

import json
from typing import Any

ALL_TYPES: frozenset[str] = frozenset(
    {"string", "number", "integer", "boolean", "null", "array", "object"}
)
NUMERIC: frozenset[str] = frozenset({"number", "integer"})
STRING: frozenset[str] = frozenset({"string"})
ARRAY: frozenset[str] = frozenset({"array"})
OBJECT: frozenset[str] = frozenset({"object"})

KEYWORD_TYPES: dict[str, frozenset[str]] = {
    **dict.fromkeys(
        ("multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"), NUMERIC
    ),
    **dict.fromkeys(("maxLength", "minLength", "pattern", "format"), STRING),
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
        ARRAY,
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
        OBJECT,
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
        ALL_TYPES,
    ),
}
"""Assertion keywords (every other keyword is an annotation) and the instance types each one
constrains."""

ASSERTIONS: frozenset[str] = frozenset(KEYWORD_TYPES)


def canon(value: Any) -> str:
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


def value_type(value: Any) -> str:
    """The JSON type name of a value ("integer" for Python ints, "number" for floats)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def value_types(value: Any) -> frozenset[str]:
    """Every type name a value satisfies (an integral number is "integer" and "number")."""
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if value is None:
        return frozenset({"null"})
    if isinstance(value, int):
        return NUMERIC
    if isinstance(value, float):
        return NUMERIC if value.is_integer() else frozenset({"number"})
    if isinstance(value, str):
        return STRING
    if isinstance(value, list):
        return ARRAY
    return OBJECT


def raw_types(t: Any) -> set[str]:
    """The type names a ``type`` keyword's value lists (nothing for a malformed one)."""
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def declared_types(node: dict[str, Any]) -> frozenset[str]:
    """The instance types a schema's ``type`` allows (all when it has none); "number"
    includes "integer"."""
    t = node.get("type")
    if not isinstance(t, (str, list)):
        return ALL_TYPES
    names = raw_types(t)
    if "number" in names:
        names.add("integer")
    return frozenset(names & ALL_TYPES)


def within(inner: set[str], outer: set[str]) -> bool:
    """Whether every instance of types ``inner`` is of types ``outer``."""
    return all(t in outer or (t == "integer" and "number" in outer) for t in inner)


def json_type_ok(value: Any, types: set[str]) -> bool:
    """Whether ``value`` is of one of ``types`` (JSON Schema's reading: 1.0 is an integer)."""
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if isinstance(value, str):
        return "string" in types
    if value is None:
        return "null" in types
    if isinstance(value, list):
        return "array" in types
    return isinstance(value, dict) and "object" in types


def type_intersection(a: Any, b: Any) -> list[str]:
    """The type names both ``type`` values allow, in a fixed order."""
    sa = {a} if isinstance(a, str) else set(a)
    sb = {b} if isinstance(b, str) else set(b)
    out = sa & sb
    if ("number" in sa and "integer" in sb) or ("integer" in sa and "number" in sb):
        out.add("integer")
    order = ["null", "boolean", "object", "array", "number", "integer", "string"]
    return [t for t in order if t in out]


__all__ = [
    "ALL_TYPES",
    "ARRAY",
    "ASSERTIONS",
    "KEYWORD_TYPES",
    "NUMERIC",
    "OBJECT",
    "STRING",
    "canon",
    "declared_types",
    "json_type_ok",
    "raw_types",
    "type_intersection",
    "value_type",
    "value_types",
    "within",
]
