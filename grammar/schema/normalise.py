"""Normalisation passes over JSON schemas, shared by the backends: each returns a schema with
the same instances (or, for ``close_object_schemas``, the closed objects baton reads by
default)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from baton.grammar.schema.disjoint import branches_disjoint
from baton.grammar.schema.refs import inside_a_target, ref_target_paths


def close_object_schemas(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that declares its names (``properties``
    or ``patternProperties``) and says nothing of the others (no ``additionalProperties`` or
    ``unevaluatedProperties``) gets ``additionalProperties: false``: baton's default reading
    (closed objects), as xgrammar's strict mode and vLLM read such schemas. An object that
    declares no names (``{"type": "object"}``: any object) stays open: closed, it would admit
    ``{}`` alone, which no schema author means by it."""
    return _set_absent_additional(schema, False, declared_only=True)


def close_every_object(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) gets ``additionalProperties: false``, those that declare no names
    too (then ``{}`` alone): vLLM's ``disable_additional_properties``."""
    return _set_absent_additional(schema, False)


def open_object_schemas(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) gets ``additionalProperties: {}``: what JSON Schema reads there,
    written out for a backend that reads it absent as false (xgrammar's strict mode). The same
    instances as ``schema`` unless an ``unevaluatedProperties`` looks at the object's names
    (it would then see them all evaluated): callers refuse such schemas
    (``uses_keyword(schema, "unevaluatedProperties")``)."""
    return _set_absent_additional(schema, {})


def object_policy(schema: Any, open_objects: bool) -> Any:
    """``schema`` as a request reads it: closed objects (``close_object_schemas``) unless it
    asked for open ones, when it is returned as given (JSON Schema's own reading)."""
    return schema if open_objects else close_object_schemas(schema)


def _set_absent_additional(schema: Any, value: Any, declared_only: bool = False) -> Any:
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        t = node.get("type")
        is_object = t == "object" or (isinstance(t, list) and "object" in t)
        declares = "properties" in node or "patternProperties" in node
        if (
            (is_object or (t is None and "properties" in node))
            and (declares or not declared_only)
            and not ("additionalProperties" in node or "unevaluatedProperties" in node)
        ):
            node["additionalProperties"] = copy.deepcopy(value)
        for key, child in node.items():
            if key in _DATA_KEYWORDS:
                continue
            if key in _NAME_MAPS:
                if isinstance(child, dict):
                    stack.extend(child.values())
            elif isinstance(child, (dict, list)):
                stack.append(child)
    return schema


# Keys whose value is data (or names), never a subschema.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})
# Keys whose value maps names to subschemas.
_NAME_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def uses_keyword(schema: Any, keyword: str) -> bool:
    """Whether any subschema of ``schema`` has the key ``keyword`` (data values such as
    ``enum`` and ``const`` are not looked into)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if keyword in node:
                return True
            for key, child in node.items():
                if key in _DATA_KEYWORDS:
                    continue
                stack.extend(
                    child.values() if key in _NAME_MAPS and isinstance(child, dict) else [child]
                )
    return False


# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
SCHEMA_KEYWORDS = frozenset(
    {
        "additionalProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "items",
    }
)
SCHEMA_LIST_KEYWORDS = frozenset({"prefixItems", "allOf", "anyOf", "oneOf", "items"})
SCHEMA_MAP_KEYWORDS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
COUNT_KEYWORDS = frozenset(
    {
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "minContains",
        "maxContains",
    }
)

Path = tuple[str, ...]
Rewrite = Callable[[dict[str, Any], Path], dict[str, Any]]


def map_schemas(schema: Any, rewrite: Rewrite, path: Path = ()) -> Any:
    """A copy of ``schema`` with ``rewrite(node, path)`` applied to every subschema object,
    innermost first (``path``: the JSON-pointer tokens of the node in the original schema).
    Values that are data (``enum``, ``const``, ``default``, ``examples``) are left alone."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        here = (*path, key)
        if key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            out[key] = {k: map_schemas(v, rewrite, (*here, k)) for k, v in value.items()}
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            out[key] = [map_schemas(v, rewrite, (*here, str(i))) for i, v in enumerate(value)]
        elif key in SCHEMA_KEYWORDS:
            out[key] = map_schemas(value, rewrite, here)
        else:
            out[key] = value
    return rewrite(out, path)


def integral_counts(schema: Any) -> Any:
    """``schema`` with count keywords written as integral numbers (``"maxItems": 2.0``, which
    JSON Schema allows) turned into ints, which every backend reads; ``schema`` itself when
    it has none."""
    if not _has_float_count(schema):
        return schema

    def rewrite(node: dict[str, Any], _: Path) -> dict[str, Any]:
        for key in COUNT_KEYWORDS & set(node):
            value = node[key]
            if isinstance(value, float) and value.is_integer():
                node[key] = int(value)
        return node

    return map_schemas(schema, rewrite)


def _has_float_count(schema: Any) -> bool:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in COUNT_KEYWORDS and isinstance(value, float):
                    return True
                if key not in ("enum", "const", "default", "examples"):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return False


DEFINED_FORMATS: frozenset[str] = frozenset(
    {
        "date-time",
        "date",
        "time",
        "duration",
        "email",
        "idn-email",
        "hostname",
        "idn-hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "iri",
        "iri-reference",
        "uuid",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "regex",
    }
)
"""The formats JSON Schema defines; any other ``format`` value is an annotation that no
validator checks."""


def drop_unknown_formats(schema: Any) -> Any:
    """``schema`` without ``format`` values JSON Schema does not define (annotations: every
    instance satisfies them), for a backend that refuses formats it does not know."""

    def rewrite(node: dict[str, Any], _: Path) -> dict[str, Any]:
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in DEFINED_FORMATS:
            del node["format"]
        return node

    return map_schemas(schema, rewrite)


def disjoint_one_of_as_any_of(schema: Any) -> Any:
    """``schema`` with every ``oneOf`` whose branches are provably disjoint
    (``disjoint.branches_disjoint``) written as ``anyOf``, which then has the same instances;
    left alone where a ``$ref`` points inside it, or beside an ``anyOf``."""
    if not isinstance(schema, dict):
        return schema
    targets = ref_target_paths(schema)

    def rewrite(node: dict[str, Any], path: Path) -> dict[str, Any]:
        branches = node.get("oneOf")
        if (
            not isinstance(branches, list)
            or "anyOf" in node
            or inside_a_target((*path, "oneOf"), targets)
            or (*path, "oneOf") in targets
            or not branches_disjoint(branches, schema)
        ):
            return node
        return {("anyOf" if k == "oneOf" else k): v for k, v in node.items()}

    return map_schemas(schema, rewrite)


__all__ = [
    "COUNT_KEYWORDS",
    "SCHEMA_KEYWORDS",
    "SCHEMA_LIST_KEYWORDS",
    "SCHEMA_MAP_KEYWORDS",
    "DEFINED_FORMATS",
    "close_object_schemas",
    "disjoint_one_of_as_any_of",
    "drop_unknown_formats",
    "integral_counts",
    "map_schemas",
    "object_policy",
    "open_object_schemas",
    "uses_keyword",
]
