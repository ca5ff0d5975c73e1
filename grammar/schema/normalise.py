"""Normalisation passes over JSON schemas, shared by the backends."""

from __future__ import annotations

import copy
from typing import Any


def close_object_schemas(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` (or
    ``unevaluatedProperties``) gets ``additionalProperties: false``."""
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
        if (is_object or (t is None and "properties" in node)) and not (
            "additionalProperties" in node or "unevaluatedProperties" in node
        ):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in (
                "properties",
                "patternProperties",
                "$defs",
                "definitions",
                "dependentSchemas",
            ):
                if isinstance(value, dict):
                    stack.extend(value.values())
            elif key in ("enum", "const", "default", "examples", "required"):
                continue
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return schema


__all__ = ["close_object_schemas"]
