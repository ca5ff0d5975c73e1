"""The JSON-schema keywords xgrammar enforces and the ones it silently ignores, as data, and
the walk that finds the ignored ones in a schema (``xgrammar_unenforced_keywords``), so that
the xgrammar backend refuses such a schema (or "auto" passes it on).

Measured with xgrammar 0.2.9; ``tests/grammar/test_grammar_xgrammar.py`` shows each entry with an
instance.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from baton.grammar.schema.disjoint import branches_disjoint
from baton.grammar.schema.pattern_regex import may_search
from baton.grammar.schema.refs import (
    is_local_ref,
    resolve_local_ref,
)
from baton.grammar.schema.types import json_type_ok, raw_types, value_type, within

# ---------------------------------------------------------------------------- enforcement table
# Measured by compiling schemas with strict_mode=True (what the backend uses) and walking valid
# and invalid instances through a matcher. "Enforced" means an invalid instance is rejected; some
# enforced keywords are stricter than JSON Schema (noted), which only ever rejects valid output.

XGRAMMAR_ENFORCED_KEYWORDS: Mapping[str, str] = {
    "type": "all seven types and type lists",
    "enum": "exact values; wins over sibling keywords (see xgrammar_unenforced_keywords)",
    "const": "exact value; wins over enum and other siblings",
    "properties": "in the schema's declared order only; xgrammar reads an untyped schema "
    "with properties as objects only (the normal form splits it by type first)",
    "required": "for declared properties only",
    "additionalProperties": "false or a schema; strict mode reads it absent as false: the "
    "normal form writes {} for an object that declares no property (and no patternProperties, "
    "propertyNames or unevaluatedProperties anywhere); an object with declared properties "
    "stays closed to other names (stricter than JSON Schema)",
    "unevaluatedProperties": "false is what strict mode does anyway",
    "minProperties": "with properties or additionalProperties (or type object)",
    "maxProperties": "with properties or additionalProperties (or type object)",
    "propertyNames": "checked on additional keys, not on declared property names",
    "patternProperties": "keys must match a pattern in full (the normal form gives an "
    "unanchored side any text, as JSON Schema searches), values its schema; "
    "not beside properties plus a non-false additionalProperties (then ignored); a key gets "
    "one schema only (its declared property's, else one fully matching pattern's), so several "
    "patterns with different schemas, or a pattern that may match a declared name, are "
    "reported",
    "items": "a schema or false (an array of schemas, draft 4 tuples, fails to compile)",
    "prefixItems": "positional schemas; with strict mode no further items unless items allows",
    "unevaluatedItems": "false is what strict mode does anyway",
    "minItems": "with items or prefixItems (or type array)",
    "maxItems": "with items or prefixItems (or type array)",
    "minLength": "unless beside pattern or format (then ignored); such a string holds plain "
    "characters only, no escape sequence (stricter than JSON Schema)",
    "maxLength": "unless beside pattern or format (then ignored); such a string holds plain "
    "characters only, no escape sequence (stricter than JSON Schema)",
    "pattern": "matched against the whole string (the normal form gives an unanchored side "
    "any text, as JSON Schema searches, except beside an inner anchor, a (?...) group or a "
    "count past 128); such a string holds no escape sequence (stricter than JSON Schema); "
    "lookarounds are ignored; one that counts a repetition past 128 holds plain characters "
    "only, no escape sequence (stricter than JSON Schema); an optional group is written "
    "(...){0,1}, which xgrammar reads right (it misread (...)?)",
    "format": "the formats in XGRAMMAR_ENFORCED_FORMATS, syntax only (no calendar checks); "
    "uri-reference and uri-template as the normal form's patterns (xgrammar's own uri-reference "
    "took relative references only)",
    "minimum": "integer and number; a number with a bound is written with at most 6 fraction "
    "digits and no exponent (stricter than JSON Schema)",
    "maximum": "integer and number; a number with a bound is written with at most 6 fraction "
    "digits and no exponent (stricter than JSON Schema)",
    "exclusiveMinimum": "numeric form (the draft 4 boolean form fails to compile)",
    "exclusiveMaximum": "numeric form (the draft 4 boolean form fails to compile)",
    "multipleOf": "integer type with an integer divisor only",
    "anyOf": "alternatives; sibling keywords are ignored",
    "oneOf": "treated as anyOf: an instance matching several branches is accepted",
    "allOf": "a single subschema only; sibling keywords are ignored",
    "$ref": "local JSON pointers ('#', '#/...'), recursion included; sibling keywords are ignored",
}

XGRAMMAR_UNENFORCED_KEYWORDS: Mapping[str, str] = {
    "not": "ignored",
    "if": "if/then/else ignored",
    "dependentRequired": "ignored",
    "dependentSchemas": "ignored",
    "dependencies": "ignored",
    "uniqueItems": "ignored (duplicates accepted)",
    "contains": "ignored (minContains/maxContains with it)",
    "$dynamicRef": "resolves to any value",
    "$recursiveRef": "resolves to any value",
}

# JSON Schema's defined string formats, split by whether xgrammar checks them.
XGRAMMAR_ENFORCED_FORMATS: frozenset[str] = frozenset(
    {
        "date",
        "date-time",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)
XGRAMMAR_UNENFORCED_FORMATS: frozenset[str] = frozenset(
    {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
)

# Keywords that only act through another one (if, contains), reported under that one.
DEPENDENT_KEYWORDS = frozenset({"then", "else", "minContains", "maxContains"})
VALIDATING_KEYWORDS = (
    frozenset(XGRAMMAR_ENFORCED_KEYWORDS)
    | frozenset(XGRAMMAR_UNENFORCED_KEYWORDS)
    | DEPENDENT_KEYWORDS
    | {"additionalItems"}
)
# Anything else (title, description, default, $defs, $id, x-..., unknown words) is an annotation.
# When a schema holds several of these, xgrammar builds it from the first alone.
DOMINANT_ORDER = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")

TYPE_KEYWORDS: dict[str, tuple[str, ...]] = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("minItems", "maxItems"),
    "object": ("required", "minProperties", "maxProperties", "propertyNames", "patternProperties"),
}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def built_types(node: Mapping[str, Any]) -> set[str] | None:
    """The types xgrammar builds ``node`` for; None when it accepts any value."""
    t = node.get("type")
    if isinstance(t, str):
        types = {t}
    elif isinstance(t, list):
        types = {x for x in t if isinstance(x, str)}
    elif "properties" in node or "additionalProperties" in node:
        types = {"object"}
    elif "items" in node or "prefixItems" in node:
        types = {"array"}
    else:
        return None
    if "integer" in types:
        types.add("number")
    return types


def _possible_types(node: Any, root: Any, depth: int) -> set[str] | None:
    """The JSON types xgrammar's grammar for ``node`` can produce; None when any or unknown."""
    if not isinstance(node, dict) or depth > 32:
        return None
    if "$ref" in node:
        ref = node["$ref"]
        if not is_local_ref(ref):
            return None
        return _possible_types(resolve_local_ref(root, ref), root, depth + 1)
    if "const" in node:
        return {value_type(node["const"])}
    if "enum" in node:
        values = node["enum"]
        return {value_type(v) for v in values} if isinstance(values, list) else None
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node:
            branches = node[key]
            if not isinstance(branches, list) or (key == "allOf" and len(branches) != 1):
                return None
            out: set[str] = set()
            for branch in branches:
                types = _possible_types(branch, root, depth + 1)
                if types is None:
                    return None
                out |= types
            return out
    types = built_types(node)
    if types is None:
        return None
    return raw_types(node["type"]) if "type" in node else types


def oneof_branches_disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no instance can match two ``oneOf`` branches, provably and cheaply
    (``disjoint.branches_disjoint``, JSON Schema's semantics).

    xgrammar builds ``oneOf`` as an alternation (``anyOf``): exclusivity is enforced only when
    the branches cannot overlap. Not what xgrammar's grammar of each branch produces: it
    writes an untyped branch with ``properties`` as objects only, yet under JSON Schema that
    branch also matches every non-object, which another branch may match too.
    """
    return branches_disjoint(branches, root)


def _values_satisfy(values: list[Any], siblings: dict[str, Any], root: Any) -> bool:
    """Whether every enum/const value is valid under the sibling keywords xgrammar drops."""
    if set(siblings) == {"type"}:
        types = built_types(siblings)
        return types is not None and all(json_type_ok(v, types) for v in values)
    try:
        import jsonschema  # a dev dependency: without it, be conservative
    except ImportError:
        return False
    sub: dict[str, Any] = dict(siblings)
    if isinstance(root, dict):
        for defs in ("$defs", "definitions"):
            if defs in root:
                sub[defs] = root[defs]
    try:
        validator = jsonschema.Draft202012Validator(sub)
        return all(validator.is_valid(v) for v in values)
    except Exception:  # noqa: BLE001 - an unresolvable sibling: assume the worst
        return False


def _subschemas(node: Mapping[str, Any]) -> Iterator[Any]:
    """The subschemas of a schema without a dominant keyword that xgrammar builds."""
    if isinstance(node.get("properties"), dict):
        yield from node["properties"].values()
    for key in ("additionalProperties", "unevaluatedProperties", "items"):
        if isinstance(node.get(key), dict):
            yield node[key]
    names = node.get("propertyNames")
    if isinstance(names, dict):
        # Property names are strings: xgrammar applies string keywords without a type here.
        yield names if "type" in names else {"type": "string", **names}
    if isinstance(node.get("patternProperties"), dict):
        yield from node["patternProperties"].values()
    if isinstance(node.get("prefixItems"), list):
        yield from node["prefixItems"]


def xgrammar_unenforced_keywords(schema: Any) -> set[str]:
    """The keywords of a JSON schema that xgrammar would not enforce.

    Walks the schema from its root, following local ``$ref``s (unreferenced
    ``$defs`` do not count), and reports, each as a short label:
    keywords of ``XGRAMMAR_UNENFORCED_KEYWORDS`` (e.g. ``"not"``); string
    formats xgrammar does not check (``"format (iri)"``); keywords dropped
    because a sibling wins (``"minimum (beside $ref)"``, ``"type (beside
    anyOf)"``, an ``enum`` sibling only when an enum value violates it);
    ``"allOf (several subschemas)"``; type-specific keywords in a schema
    without a type (``"minimum (no type)"``); ``"multipleOf (number)"``;
    ``"minLength (beside pattern/format)"``, ``"pattern (beside format)"``,
    ``"pattern (lookaround)"``; ``"patternProperties (lookaround)"``,
    ``"patternProperties (beside additionalProperties)"``, ``"patternProperties (several
    patterns)"``, ``"patternProperties (matches a declared property)"``; ``"required
    (undeclared property)"``; ``"propertyNames (declared properties)"``;
    ``"$ref (non-local)"``; ``"oneOf (overlapping branches)"`` when the
    branches are not provably disjoint (xgrammar builds ``oneOf`` as ``anyOf``).

    Unknown keywords are annotations under JSON Schema and are not reported.
    Never raises on odd input: parts that are not schemas are skipped.
    """
    found: set[str] = set()
    seen: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        _check_node(node, schema, found, stack)
    return found


def _check_node(node: dict[str, Any], root: Any, found: set[str], stack: list[Any]) -> None:
    keys = set(node)
    for kw in keys & set(XGRAMMAR_UNENFORCED_KEYWORDS):
        if kw == "uniqueItems" and node[kw] is not True:
            continue
        found.add(kw)
    dominant = next((k for k in DOMINANT_ORDER if k in keys), None)
    siblings = {
        k: node[k]
        for k in keys
        if k in VALIDATING_KEYWORDS
        and k != dominant
        and k not in XGRAMMAR_UNENFORCED_KEYWORDS
        and k not in DEPENDENT_KEYWORDS
    }
    if dominant is not None:
        if dominant in ("const", "enum"):
            values = [node["const"]] if dominant == "const" else node.get("enum")
            if siblings and not (
                isinstance(values, list) and _values_satisfy(values, siblings, root)
            ):
                found.update(f"{k} (beside {dominant})" for k in siblings)
            return
        if "type" in siblings:
            # A dropped type costs nothing when the dominant keyword only yields those types.
            only = _possible_types({dominant: node[dominant]}, root, 0)
            if only is not None and within(only, raw_types(siblings["type"])):
                del siblings["type"]
        found.update(f"{k} (beside {dominant})" for k in siblings)
        if dominant == "$ref":
            ref = node["$ref"]
            if is_local_ref(ref):
                stack.append(resolve_local_ref(root, ref))
            else:
                found.add("$ref (non-local)")
        elif isinstance(node[dominant], list):
            if dominant == "allOf" and len(node["allOf"]) > 1:
                found.add("allOf (several subschemas)")
            else:
                if dominant == "oneOf" and not oneof_branches_disjoint(node["oneOf"], root):
                    found.add("oneOf (overlapping branches)")
                stack.extend(node[dominant])
        return
    types = built_types(node)
    if types is None:
        for kws in TYPE_KEYWORDS.values():
            for kw in kws:
                if kw in keys and not (
                    kw == "format" and node[kw] not in XGRAMMAR_ENFORCED_FORMATS
                ):
                    found.add(f"{kw} (no type)")
    else:
        _check_typed(node, types, found)
    stack.extend(_subschemas(node))


def _check_typed(node: dict[str, Any], types: set[str], found: set[str]) -> None:
    if "multipleOf" in node:
        divisor = node["multipleOf"]
        integral = isinstance(divisor, int) or (isinstance(divisor, float) and divisor.is_integer())
        if "number" in types and ("integer" not in types or not integral):
            found.add("multipleOf (number)")
    if "string" in types:
        fmt = node.get("format")
        pattern = node.get("pattern")
        if fmt in XGRAMMAR_UNENFORCED_FORMATS:
            found.add(f"format ({fmt})")
        checked_format = fmt in XGRAMMAR_ENFORCED_FORMATS
        if checked_format and pattern is not None:
            found.add("pattern (beside format)")
        if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
            found.add("pattern (lookaround)")
        if checked_format or pattern is not None:
            found.update(
                f"{kw} (beside pattern/format)" for kw in ("minLength", "maxLength") if kw in node
            )
    if "object" in types:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required")
        if isinstance(required, list) and any(r not in props for r in required):
            found.add("required (undeclared property)")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and any(_LOOKAROUND.search(p) for p in patterns):
            found.add("patternProperties (lookaround)")
        extra = node.get("additionalProperties", False)
        if props and "patternProperties" in node and extra is not False:
            found.add("patternProperties (beside additionalProperties)")
        if isinstance(patterns, dict):
            found.update(_pattern_overlaps(patterns, props))
        names = node.get("propertyNames")
        if props and isinstance(names, dict) and not _values_satisfy(list(props), names, None):
            found.add("propertyNames (declared properties)")


def _pattern_overlaps(patterns: dict[str, Any], props: dict[str, Any]) -> set[str]:
    """xgrammar gives a key one schema: its declared property's, else that of one pattern it
    matches in full. JSON Schema applies every pattern that matches anywhere in the key."""
    found: set[str] = set()
    schemas = {json.dumps(v, sort_keys=True) for v in patterns.values()}
    if len(schemas) > 1:
        found.add("patternProperties (several patterns)")
    strict = [p for p, v in patterns.items() if v not in ({}, True)]
    if any(may_search(p, name) for p in strict for name in props):
        found.add("patternProperties (matches a declared property)")
    return found


__all__ = [
    "DEPENDENT_KEYWORDS",
    "DOMINANT_ORDER",
    "TYPE_KEYWORDS",
    "VALIDATING_KEYWORDS",
    "XGRAMMAR_ENFORCED_FORMATS",
    "XGRAMMAR_ENFORCED_KEYWORDS",
    "XGRAMMAR_UNENFORCED_FORMATS",
    "XGRAMMAR_UNENFORCED_KEYWORDS",
    "built_types",
    "oneof_branches_disjoint",
    "xgrammar_unenforced_keywords",
]
