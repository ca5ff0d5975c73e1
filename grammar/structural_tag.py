"""Structural tags as data: the one normal form, and the JSON-schema contents inside one.

A structural tag (xgrammar's format) describes output made of free text, literal tags and
constrained contents (JSON schemas, regexes, grammars). baton accepts two spellings: xgrammar's
``{"type": "structural_tag", "format": {...}}`` and the older OpenAI-style
``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``. Everything that reads a
tag (validation, the enforceability check, the xgrammar backend) first brings it to the first
form with ``normalise_structural_tag`` and finds its JSON-schema contents with
``json_schema_formats``, so that a schema inside a tag is checked like a ``json`` spec.

Nothing here depends on a backend.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from baton.grammar.spec import StructuredOutputsParams


def normalise_structural_tag(value: dict[str, Any] | str) -> dict[str, Any]:
    """``value`` (a dict or JSON text) in xgrammar's form; the legacy ``structures`` +
    ``triggers`` form becomes a ``triggered_tags`` format. Returns a new dict.

    Raises:
        ValueError: the text is not JSON, or the tag is not a JSON object, or a legacy
            structure lacks ``begin`` or ``end``.
    """
    if isinstance(value, str):
        try:
            tag = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    else:
        tag = copy.deepcopy(value)
    if not isinstance(tag, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {type(tag).__name__}")
    if "structures" not in tag or "format" in tag:
        return tag
    structures = tag["structures"]
    if not isinstance(structures, list):
        raise ValueError("structural_tag.structures must be a list")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or "begin" not in s or "end" not in s:
            raise ValueError(f"structural_tag.structures[{i}] needs begin and end")
        tags.append(
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {
                    "type": "json_schema",
                    "json_schema": s.get("schema", s.get("parameters", {})),
                },
                "end": s["end"],
            }
        )
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags},
    }


def _is_json_format(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "json_schema" and "json_schema" in node


def json_schema_formats(tag: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``{"type": "json_schema", ...}`` format of a normalised tag, in document order
    (the format dicts themselves, not copies). A schema's own insides are never searched."""
    found: list[dict[str, Any]] = []
    stack: list[Any] = [tag]
    while stack:
        node = stack.pop()
        if _is_json_format(node):
            found.append(node)
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return found


def map_json_schema_formats(
    tag: dict[str, Any], fn: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """A copy of the normalised ``tag`` with every JSON-schema format replaced by
    ``fn(format)`` (iterative: a deep tag cannot exhaust the stack)."""
    root: dict[str, Any] = {"tag": copy.deepcopy(tag)}
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in list(items):
            if _is_json_format(child):
                node[key] = fn(child)
            elif isinstance(child, (dict, list)):
                stack.append(child)
    return root["tag"]


def spec_format(spec: StructuredOutputsParams) -> dict[str, Any]:
    """``spec``'s constraint as one structural-tag format, to place inside a larger tag (for
    example, the answer a model gives when it calls no tool). Its options (whitespace,
    backend) are the enclosing spec's business.

    Raises:
        ValueError: the spec's text is not valid (a schema or structural tag that is not JSON).
    """
    kind = spec.kind
    if kind == "json":
        return {"type": "json_schema", "json_schema": spec.schema}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "regex":
        return {"type": "regex", "pattern": spec.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec.grammar}
    if kind == "choice":
        choices = list(dict.fromkeys(spec.choice or ()))
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}
    tag = normalise_structural_tag(spec.structural_tag or {})
    if "format" not in tag:
        raise ValueError("structural_tag has no format")
    return tag["format"]
