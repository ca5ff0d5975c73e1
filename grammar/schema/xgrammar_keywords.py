"""The JSON-schema keywords xgrammar enforces and the ones it silently ignores, as data, and
the walk that finds the ignored ones in a schema (``xgrammar_unenforced_keywords``), so that
the xgrammar backend refuses such a schema (or "auto" passes it on).

Measured with xgrammar 0.2.9; ``tests/test_grammar_xgrammar.py`` shows each entry with an
instance.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from baton.grammar.schema.disjoint import branches_disjoint
from baton.grammar.schema.normalise import Path, integral_counts, map_schemas
from baton.grammar.schema.outlines_merge import cousins_ok, merge_schemas
from baton.grammar.schema.refs import (
    inside_a_target,
    is_local_ref,
    ref_target_paths,
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
    "properties": "in the schema's declared order only; implies type object when type is absent",
    "required": "for declared properties only",
    "additionalProperties": "false or a schema; with strict mode an object that declares "
    "properties allows no other keys unless additionalProperties says so",
    "unevaluatedProperties": "false is what strict mode does anyway",
    "minProperties": "with properties or additionalProperties (or type object)",
    "maxProperties": "with properties or additionalProperties (or type object)",
    "propertyNames": "checked on additional keys, not on declared property names",
    "patternProperties": "keys must match a pattern in full (anchored), values its schema; "
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
    "pattern": "anchored: an unanchored pattern must match the whole string; "
    "lookarounds are ignored; one that counts a repetition past 128 holds plain characters "
    "only, no escape sequence (stricter than JSON Schema)",
    "format": "the formats in XGRAMMAR_ENFORCED_FORMATS, syntax only (no calendar checks)",
    "minimum": "integer and number",
    "maximum": "integer and number",
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
_DEPENDENT = frozenset({"then", "else", "minContains", "maxContains"})
_VALIDATING = (
    frozenset(XGRAMMAR_ENFORCED_KEYWORDS)
    | frozenset(XGRAMMAR_UNENFORCED_KEYWORDS)
    | _DEPENDENT
    | {"additionalItems"}
)
# Anything else (title, description, default, $defs, $id, x-..., unknown words) is an annotation.
# When a schema holds several of these, xgrammar builds it from the first alone.
_DOMINANT_ORDER = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")

_TYPE_KEYWORDS: dict[str, tuple[str, ...]] = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("minItems", "maxItems"),
    "object": ("required", "minProperties", "maxProperties", "propertyNames", "patternProperties"),
}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _types_of(node: Mapping[str, Any]) -> set[str] | None:
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
    types = _types_of(node)
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
        types = _types_of(siblings)
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
    dominant = next((k for k in _DOMINANT_ORDER if k in keys), None)
    siblings = {
        k: node[k]
        for k in keys
        if k in _VALIDATING
        and k != dominant
        and k not in XGRAMMAR_UNENFORCED_KEYWORDS
        and k not in _DEPENDENT
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
    types = _types_of(node)
    if types is None:
        for kws in _TYPE_KEYWORDS.values():
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


def _may_search(pattern: str, text: str) -> bool:
    """Whether the ECMA ``pattern`` may match inside ``text`` (Python's ``re`` as the
    approximation; a pattern it cannot read counts as matching, the cautious answer)."""
    try:
        return re.search(pattern, text) is not None
    except (re.error, TypeError):
        return True


def _pattern_overlaps(patterns: dict[str, Any], props: dict[str, Any]) -> set[str]:
    """xgrammar gives a key one schema: its declared property's, else that of one pattern it
    matches in full. JSON Schema applies every pattern that matches anywhere in the key."""
    found: set[str] = set()
    schemas = {json.dumps(v, sort_keys=True) for v in patterns.values()}
    if len(schemas) > 1:
        found.add("patternProperties (several patterns)")
    strict = [p for p, v in patterns.items() if v not in ({}, True)]
    if any(_may_search(p, name) for p in strict for name in props):
        found.add("patternProperties (matches a declared property)")
    return found


# RFC 6570 URI templates, levels 1-4: literals (any character but controls, space and
# "'%<>\\^`{|}, or a %XX escape) and {expressions}. xgrammar's own uri-template grammar is
# nullable rules nested in a loop whose masks it cannot precompute: 25-43 ms per row inside
# an expression (``baton bench masks``), against 10 us for this pattern, which it builds as
# one automaton. Both keywords apply to strings only, so one stands for the other anywhere.
_VARCHAR = r"(?:[A-Za-z0-9_]|%[0-9A-Fa-f]{2})"
_VARSPEC = _VARCHAR + r"(?:\.?" + _VARCHAR + r")*(?::[1-9][0-9]{0,3}|\*)?"
URI_TEMPLATE_PATTERN = (
    r"""^(?:[^\x00-\x20"'%<>\\^`{|}\x7f]|%[0-9A-Fa-f]{2}"""
    + r"|\{[+#./;?&=,!@|]?"
    + _VARSPEC
    + r"(?:,"
    + _VARSPEC
    + r")*\})*$"
)
_FORMAT_PATTERNS = {"uri-template": URI_TEMPLATE_PATTERN}

# Every JSON type once ("number" covers "integer"), in the order the rest branch lists them.
_JSON_TYPES = ("null", "boolean", "number", "string", "array", "object")
_DEFINED_FORMATS = XGRAMMAR_ENFORCED_FORMATS | XGRAMMAR_UNENFORCED_FORMATS
_TYPED = frozenset(k for keywords in _TYPE_KEYWORDS.values() for k in keywords)


def _typed_split(node: dict[str, Any]) -> dict[str, Any] | None:
    """An untyped schema with type-specific keywords as an ``anyOf`` of one branch per type
    family that its keywords constrain, plus one for every other type; None when xgrammar
    already reads ``node`` whole (a type, a dominant keyword, or a keyword it infers a type
    from) or it has no type-specific keyword.

    xgrammar builds such a schema as "any value" and drops those keywords (``"minLength (no
    type)"``); JSON Schema applies each keyword to its own type only, which the branches say.
    """
    if _types_of(node) is not None or any(k in node for k in _DOMINANT_ORDER):
        return None
    families = [
        family
        for family, keywords in _TYPE_KEYWORDS.items()
        if any(k in node and (k != "format" or node[k] in _DEFINED_FORMATS) for k in keywords)
    ]
    if not families:
        return None
    branches: list[Any] = [
        {"type": family, **{k: node[k] for k in _TYPE_KEYWORDS[family] if k in node}}
        for family in families
    ]
    rest = [t for t in _JSON_TYPES if t not in families]
    if rest:
        branches.append({"type": rest})
    return {**{k: v for k, v in node.items() if k not in _TYPED}, "anyOf": branches}


# Keywords xgrammar's walk reports wherever they appear: a merge may keep either copy.
_KEEP_ONE = frozenset(XGRAMMAR_UNENFORCED_KEYWORDS) | _DEPENDENT
_APPLICATORS = ("anyOf", "oneOf", "allOf", "$ref", "$dynamicRef", "$recursiveRef")
_MERGE_ROUNDS = 4


def _merged_all_of(node: dict[str, Any], root: Any) -> dict[str, Any] | None:
    """A schema with an ``allOf`` as the one schema its members and siblings say together
    (``outlines_merge.merge_schemas``, a member that is only a local ``$ref`` read as its
    target); None when they cannot be merged: xgrammar builds a several-member allOf from
    its first member alone."""
    members = node.get("allOf")
    if not isinstance(members, list) or any(k in node for k in _APPLICATORS[:2]):
        return None
    parts: list[dict[str, Any]] = [{k: v for k, v in node.items() if k != "allOf"}]
    for member in members:
        if member is True:
            continue
        if isinstance(member, dict) and set(member) & {"$ref"}:
            extra = {k for k in member if k in _VALIDATING} - {"$ref"}
            target = (
                resolve_local_ref(root, member["$ref"]) if is_local_ref(member["$ref"]) else None
            )
            if extra or not isinstance(target, dict):
                return None
            member = target
        if not isinstance(member, dict) or any(k in member for k in _APPLICATORS):
            return None
        parts.append(member)
    if any(
        isinstance(p.get(k), bool) for p in parts for k in ("exclusiveMinimum", "exclusiveMaximum")
    ) or not cousins_ok(parts):
        return None  # draft 4's boolean bounds modify minimum/maximum; unevaluated* see cousins
    merged: dict[str, Any] | None = parts[0]
    for part in parts[1:]:
        merged = merge_schemas(merged, part, _KEEP_ONE)
        if merged is None:
            return None
    return merged


def xgrammar_normal_form(schema: Any) -> Any:
    """``schema`` in the shape baton hands xgrammar, with the same instances: integral counts
    as ints, every ``allOf`` merged into one schema where it can be (``_merged_all_of``,
    repeated for the allOfs a merge writes), a boolean ``propertyNames`` and drafts 4-2019's
    tuple ``items`` in the forms xgrammar takes, formats xgrammar fills slowly written as the
    equivalent ``pattern`` (``_FORMAT_PATTERNS``, where no pattern is there already), and
    every untyped subschema with type-specific keywords split by type (``_typed_split``), and
    an array without ``items`` given ``items: {}`` (strict mode would allow no item); a
    subschema a ``$ref`` points inside is left alone. ``schema`` itself when nothing
    changes."""
    schema = integral_counts(schema)
    if not isinstance(schema, dict):
        return schema
    targets = ref_target_paths(schema)
    root = schema
    changed = False

    def pointed_into(path: Path, keys: Iterable[str]) -> bool:
        """Whether a $ref points at or below one of the node's ``keys``."""
        return any(
            inside_a_target((*path, key), targets) or (*path, key) in targets for key in keys
        )

    def merge(node: dict[str, Any], path: Path) -> dict[str, Any]:
        nonlocal changed
        # A merge moves what lies below the node, but its definitions: a $ref into it would
        # break.
        if "allOf" not in node or pointed_into(path, node.keys() - {"$defs", "definitions"}):
            return node
        merged = _merged_all_of(node, root)
        if merged is None:
            return node
        changed = True
        return merged

    def draft_forms(node: dict[str, Any], path: Path) -> dict[str, Any]:
        nonlocal changed
        out = node
        names = node.get("propertyNames")
        if isinstance(names, bool):
            # xgrammar takes only a schema here. true: any name; false: no property at all.
            out = {k: v for k, v in node.items() if k != "propertyNames"}
            if names is False:
                out["maxProperties"] = 0
        items = node.get("items")
        if isinstance(items, list) and "prefixItems" not in node:
            # Drafts 4-2019's tuple form, which xgrammar refuses: items as a list is 2020-12's
            # prefixItems, additionalItems its items. Without additionalItems more items are
            # allowed, which strict mode would forbid unless items says so.
            if pointed_into(path, ("items", "additionalItems")):
                return out
            out = {k: v for k, v in out.items() if k not in ("items", "additionalItems")}
            out["prefixItems"] = items
            out["items"] = node.get("additionalItems", True)
        if out is not node:
            changed = True
        return out

    def fast_format(node: dict[str, Any], _: Path) -> dict[str, Any]:
        nonlocal changed
        fmt = node.get("format")
        if not isinstance(fmt, str) or fmt not in _FORMAT_PATTERNS or "pattern" in node:
            return node
        changed = True
        return {
            **{k: v for k, v in node.items() if k != "format"},
            "pattern": _FORMAT_PATTERNS[fmt],
        }

    def split(node: dict[str, Any], path: Path) -> dict[str, Any]:
        nonlocal changed
        # Property names are strings: xgrammar reads propertyNames' keywords as string ones.
        if pointed_into(path, node.keys() & _TYPED) or path[-1:] == ("propertyNames",):
            return node
        typed = _typed_split(node)
        if typed is None:
            return node
        changed = True
        return typed

    def open_items(node: dict[str, Any], _: Path) -> dict[str, Any]:
        nonlocal changed
        # Without items any item is allowed, but xgrammar's strict mode reads it as no item at
        # all: [] only, and no grammar at all beside minItems. items: {} is what the schema
        # says (it fills fast: 12 us per row at worst, measured). Not beside unevaluatedItems,
        # which items would switch off.
        types = node.get("type")
        if (types != "array" and not (isinstance(types, list) and "array" in types)) or (
            node.keys() & {"items", "prefixItems", "unevaluatedItems"}
        ):
            return node
        changed = True
        return {**node, "items": {}}

    out, any_change = schema, False
    for _ in range(_MERGE_ROUNDS):  # a merge may write new allOfs (a property in both)
        changed = False
        out = map_schemas(out, merge)
        any_change = any_change or changed
        if not changed:
            break
    changed = False
    out = map_schemas(out, draft_forms)
    any_change = any_change or changed
    changed = False
    out = map_schemas(out, fast_format)
    any_change = any_change or changed
    changed = False
    out = map_schemas(out, split)
    any_change = any_change or changed
    changed = False
    out = map_schemas(out, open_items)
    return out if any_change or changed else schema


__all__ = [
    "URI_TEMPLATE_PATTERN",
    "XGRAMMAR_ENFORCED_FORMATS",
    "XGRAMMAR_ENFORCED_KEYWORDS",
    "XGRAMMAR_UNENFORCED_FORMATS",
    "XGRAMMAR_UNENFORCED_KEYWORDS",
    "oneof_branches_disjoint",
    "xgrammar_normal_form",
    "xgrammar_unenforced_keywords",
]
