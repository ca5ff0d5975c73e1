"""Which JSON schemas outlines-core's converter (``build_regex_from_schema``, 0.2.x) turns into a
regex that enforces them as written, and what it would ignore in the others.

outlines-core reads one keyword per subschema, the first of properties, allOf, anyOf, oneOf,
prefixItems, enum, const, $ref, type, and drops its siblings; it concatenates allOf members,
writes oneOf as anyOf, writes a pattern unescaped (and unanchored ones with raw anchors), has
its own date-time (no offsets), time, email and uri regexes (the last three can write a bare
backslash or quote), reads a count only when it is an integer, ignores required names it does
not list, and drops a property, required or not, whose subschema hits its limit of four nested
$ref. ``check_outlines_schema`` walks a schema the way the converter does and says where the
result would not be the schema: keywords outlines would ignore (``unenforced``) or shapes it
cannot write at all (``error``). Where outlines writes a subset of a schema's instances (only
listed properties, in schema order; integers without a fraction; any-value nested at most three
levels deep) the result stays sound and is accepted.

The schema handed to outlines is the request's with a few exact normalisations: counts written
as integral floats become ints, ``true`` and annotation-only subschemas become the any-value
``{"anyOf": [{}]}`` (outlines writes a bare ``{}`` as an alternation that breaks the regex it is
embedded in), formats JSON Schema does not define are dropped, draft-4 tuple ``items`` becomes
``prefixItems``, property names are written as they appear in JSON text, $ref siblings are
dropped in drafts that ignore them, an object closed by ``additionalProperties: false`` gets
``properties: {}``, and patterns are written for the JSON text (``pattern_regex``).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

from baton.grammar.schema.disjoint import branches_disjoint
from baton.grammar.schema.normalise import (
    DEFINED_FORMATS,
    SCHEMA_KEYWORDS,
    SCHEMA_LIST_KEYWORDS,
    SCHEMA_MAP_KEYWORDS,
    Path,
    integral_counts,
    map_schemas,
    object_policy,
)
from baton.grammar.schema.pattern_regex import PatternRefused, may_search, outlines_pattern
from baton.grammar.schema.types import (
    ALL_TYPES,
    ARRAY,
    ASSERTIONS,
    KEYWORD_TYPES,
    NUMERIC,
    OBJECT,
    declared_types,
    json_type_ok,
    raw_types,
    value_types,
    within,
)

MAX_REF_DEPTH = 3
"""outlines-core's default: a $ref met inside more than this many nested $ref raises its
recursion-limit error (a property whose subschema raises it is left out)."""

_DISPATCH = (
    "properties",
    "allOf",
    "anyOf",
    "oneOf",
    "prefixItems",
    "enum",
    "const",
    "$ref",
    "type",
)
BOUNDED_CHAR = r'[^"\\\x00-\x1F]'
"""One character of a length-bounded string: no escape sequence, no raw control character."""
_NATIVE_FORMATS = frozenset({"uuid"})  # its other formats admit instances the format rejects
_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
# Object keys outlines writes into an enum/const regex as they are, neither JSON- nor
# regex-escaped.
_UNSAFE_KEY = re.compile(r'[\\.+*?()|\[\]{}^$"\x00-\x1f]')


def _any() -> dict[str, Any]:
    return {"anyOf": [{}]}


@dataclass(frozen=True)
class OutlinesSchema:
    """A schema checked for outlines-core.

    Attributes:
        schema: the normalised schema to hand ``build_regex_from_schema`` (None on error).
        unenforced: what outlines would ignore, sorted ("minimum", "pattern (lookaround)").
        error: why outlines cannot write the schema at all, or None.
        regex_chars: the predicted length of the regex outlines writes for it.
        open_with_properties: some object declares properties and admits other names too
            (outlines writes only the declared ones: a narrowing).
    """

    schema: Any
    unenforced: tuple[str, ...]
    error: str | None
    regex_chars: int
    open_with_properties: bool = False


class _Refused(Exception):
    """A shape outlines cannot write (the walk stops)."""


class _RefLimit(Exception):
    """outlines' $ref recursion limit, raised where the converter raises it."""


def _is_legacy_draft(root: Any) -> bool:
    schema = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(schema, str) and bool(re.search(r"draft-0[3-7]", schema))


def _normal_form(schema: Any, open_objects: bool) -> Any:
    """The request's schema with the exact normalisations of the module docstring, under the
    request's object policy (closed unless ``open_objects``)."""
    if schema is True:
        return {}
    schema = object_policy(integral_counts(copy.deepcopy(schema)), open_objects)
    legacy = _is_legacy_draft(schema)

    def fix(value: Any) -> Any:
        return _any() if value is True else value

    def rewrite(node: dict[str, Any], path: Path) -> dict[str, Any]:
        for key, value in node.items():
            if key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
                node[key] = [fix(v) for v in value]
            elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                node[key] = {k: fix(v) for k, v in value.items()}
            elif key in SCHEMA_KEYWORDS:
                node[key] = fix(value)
        for key in ("anyOf", "oneOf"):  # a false branch matches nothing
            branches = node.get(key)
            if (
                isinstance(branches, list)
                and False in branches
                and not all(b is False for b in branches)
            ):
                node[key] = [b for b in branches if b is not False]
        if isinstance(node.get("anyOf"), list) and any(_is_any(b) for b in node["anyOf"]):
            node["anyOf"] = [{}]
        for key in ("items", "additionalProperties"):  # outlines' own default is any value
            if _is_any(node.get(key)):
                del node[key]
        if isinstance(node.get("allOf"), list):  # an any-value member says nothing
            node["allOf"] = [m for m in node["allOf"] if not _is_any(m)]
            if not node["allOf"]:
                del node["allOf"]
        if legacy and "$ref" in node:
            node = {k: v for k, v in node.items() if k == "$ref" or k not in ASSERTIONS}
        if isinstance(node.get("items"), list) and "prefixItems" not in node:
            node["prefixItems"] = node.pop("items")
        if isinstance(node.get("format"), str) and node["format"] not in DEFINED_FORMATS:
            del node["format"]
        if isinstance(node.get("properties"), dict):
            required = node.get("required") if isinstance(node.get("required"), list) else []
            node["properties"] = {  # outlines writes only listed properties: false ones go
                _json_key(k): v
                for k, v in node["properties"].items()
                if v is not False or k in required
            }
            if isinstance(node.get("required"), list):
                node["required"] = [
                    _json_key(r) if isinstance(r, str) else r for r in node["required"]
                ]
        elif node.get("additionalProperties") is False and "object" in declared_types(node):
            node["properties"] = {}
        if not ASSERTIONS & set(node):
            return {} if not path else {**node, **_any()}
        return node

    return map_schemas(schema, rewrite)


def _is_any(value: Any) -> bool:
    """Whether a (normalised) subschema admits every value."""
    return (
        isinstance(value, dict)
        and not ASSERTIONS & (set(value) - {"anyOf"})
        and value.get("anyOf", [{}]) == [{}]
    )


def _json_key(name: str) -> str:
    """A property name as it appears between the quotes in JSON text."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _trivial(keyword: str, value: Any) -> bool:
    """True when the keyword cannot reject anything."""
    if keyword in ("minLength", "minItems", "minProperties", "minContains") and value == 0:
        return True
    if keyword == "uniqueItems" and value is False:
        return True
    if keyword in ("required", "dependentRequired", "dependentSchemas", "dependencies"):
        return not value
    if keyword in ("propertyNames", "unevaluatedItems", "unevaluatedProperties"):
        return value == _any() or value == {}
    return keyword == "patternProperties" and not value


@lru_cache(maxsize=4)
def _base_sizes(ws: str) -> dict[str, int]:
    """Lengths of the regexes outlines writes for unconstrained values, for ``ws``."""
    return {
        name: len(build_regex_from_schema(json.dumps(schema), ws))
        for name, schema in (
            ("any", {}),
            ("object", {"type": "object"}),
            ("array", {"type": "array"}),
            ("string", {"type": "string"}),
            ("number", {"type": "number"}),
            ("integer", {"type": "integer"}),
            ("uuid", {"type": "string", "format": "uuid"}),
        )
    }


Result = tuple[int, frozenset[str]]  # (predicted regex characters, types of what is written)


class _Walk:
    """One walk over a normalised schema in the converter's order (see the module docstring)."""

    def __init__(self, root: Any, ws: str) -> None:
        self.root = root
        self.ws = len(ws)
        self.base = _base_sizes(ws)
        self.unenforced: set[str] = set()
        self.memo: dict[tuple[int, int], Result | _RefLimit] = {}
        self.strings: dict[int, int] = {}  # string parts done (their pattern is rewritten)

    def walk(self, node: Any, depth: int) -> Result:
        if isinstance(node, bool):
            raise _Refused(f"a {str(node).lower()} subschema where outlines-core reads a schema")
        if not isinstance(node, dict):
            raise _Refused(f"a subschema must be an object or a boolean, got {node!r}")
        key = (id(node), depth)
        if key not in self.memo:
            try:
                self.memo[key] = self._dispatch(node, depth)
            except _RefLimit as exc:
                self.memo[key] = exc
        found = self.memo[key]
        if isinstance(found, _RefLimit):
            raise found
        return found

    def flag(self, node: dict[str, Any], out: frozenset[str], honoured: set[str]) -> None:
        """Records the assertion keywords of ``node`` that constrain what outlines writes for
        it (types ``out``) and that it does not read there."""
        for key, value in node.items():
            if key not in ASSERTIONS or key in honoured or key == "additionalItems":
                continue
            if _trivial(key, value) or not KEYWORD_TYPES[key] & out:
                continue
            if key in ("then", "else") and "if" not in node:
                continue
            if key == "if" and "then" not in node and "else" not in node:
                continue
            if key in ("minContains", "maxContains") and "contains" not in node:
                continue
            if key == "type" and within(set(out), raw_types(value)):
                continue
            self.unenforced.add(f"format ({value})" if key == "format" else key)

    def _dispatch(self, node: dict[str, Any], depth: int) -> Result:
        kind = next((k for k in _DISPATCH if k in node), None)
        if kind is None:
            if not node:
                return self.base["any"], ALL_TYPES
            families = {
                KEYWORD_TYPES[k] for k, v in node.items() if k in ASSERTIONS and not _trivial(k, v)
            }
            if len(families) == 1 and (family := next(iter(families))) != ALL_TYPES:
                # Keywords of one type only: that type is written (fewer instances, all valid),
                # as outlines itself writes only objects for properties without a type.
                node["type"] = "number" if family == NUMERIC else next(iter(family))
                return self._dispatch(node, depth)
            # outlines refuses a subschema without one of its keywords: the assertions here are
            # what it would not enforce, and the node becomes the any-value (the walk's copy).
            self.flag(node, ALL_TYPES, set())
            for key in [k for k in node if k in ASSERTIONS]:
                del node[key]
            node.update(_any())
            return self.base["any"] + 2, ALL_TYPES
        if kind == "properties":
            return self.properties(node, depth)
        if kind == "allOf":
            members = node["allOf"]
            if not isinstance(members, list) or len(members) != 1:
                raise _Refused(
                    "allOf with several subschemas (outlines-core concatenates their regexes)"
                )
            size, out = self.walk(members[0], depth)
            self.flag(node, out, {"allOf"})
            return size + 2, out
        if kind in ("anyOf", "oneOf"):
            return self.alternatives(node, kind, depth)
        if kind == "prefixItems":
            return self.prefix_items(node, depth)
        if kind in ("enum", "const"):
            return self.values(node, kind)
        if kind == "$ref":
            return self.ref(node, depth)
        return self.types(node, depth)

    def properties(self, node: dict[str, Any], depth: int) -> Result:
        props = node["properties"]
        if not isinstance(props, dict):
            raise _Refused("properties must be an object")
        if "object" not in declared_types(node):
            raise _Refused("properties beside a type without object (outlines-core writes one)")
        required = {r for r in node.get("required", []) if isinstance(r, str)}
        if required - set(props):
            self.unenforced.add("required (names not in properties)")
        written: dict[str, int] = {}
        for name, sub in props.items():
            try:
                written[name] = self.walk(sub, depth)[0]
            except _RefLimit:
                if name in required:
                    self.unenforced.add("required (at outlines-core's $ref recursion limit)")
        honoured = {"properties", "required", "additionalProperties", "unevaluatedProperties"}
        if node.get("minProperties", 0) <= len(required & set(written)):
            honoured.add("minProperties")
        if isinstance(node.get("maxProperties"), int) and node["maxProperties"] >= len(props):
            honoured.add("maxProperties")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and not any(
            may_search(p, json.loads(f'"{name}"')) for p in patterns for name in props
        ):
            honoured.add("patternProperties")
        self.flag(node, OBJECT, honoured)
        w = self.ws
        parts = [len(k) + 8 + 3 * w + size for k, size in written.items()]
        if required & set(written):
            return sum(p + w + 4 for p in parts) + 4 + w, OBJECT
        total, prefix = 0, 0
        for p in parts:
            total += prefix + p + 2
            prefix += p + w + 4
        return total + 8 + w, OBJECT

    def alternatives(self, node: dict[str, Any], kind: str, depth: int) -> Result:
        branches = node[kind]
        if not isinstance(branches, list) or not branches:
            raise _Refused(f"{kind} must be a non-empty array")
        size, out = 2, frozenset()
        for branch in branches:
            branch_size, branch_out = self.walk(branch, depth)
            size, out = size + branch_size + 5, out | branch_out
        if kind == "oneOf" and len(branches) > 1 and not branches_disjoint(branches, self.root):
            self.unenforced.add("oneOf (branches may overlap: outlines-core writes anyOf)")
        self.flag(node, out, {kind})
        return size, out

    def prefix_items(self, node: dict[str, Any], depth: int) -> Result:
        items = node["prefixItems"]
        if not isinstance(items, list):
            raise _Refused("prefixItems must be an array")
        size = 6 + 2 * self.ws + sum(self.walk(i, depth)[0] + 2 * self.ws + 1 for i in items)
        # outlines writes the whole tuple: nothing after it, nothing shorter.
        honoured = {"prefixItems", "items", "unevaluatedItems"}
        if node.get("minItems", 0) <= len(items):
            honoured.add("minItems")
        if node.get("maxItems", len(items)) >= len(items):
            honoured.add("maxItems")
        self.flag(node, ARRAY, honoured)
        return size, ARRAY

    def values(self, node: dict[str, Any], kind: str) -> Result:
        values = node["enum"] if kind == "enum" else [node["const"]]
        if not isinstance(values, list) or not values:
            raise _Refused("enum must be a non-empty array")
        for value in values:
            _check_value(value)
        out = frozenset().union(*(value_types(v) for v in values))
        honoured = {kind}
        types = raw_types(node.get("type"))
        if "type" in node and all(json_type_ok(v, types) for v in values):
            honoured.add("type")
        self.flag(node, out, honoured)
        return sum(2 * len(json.dumps(v)) + 1 for v in values) + 2, out

    def ref(self, node: dict[str, Any], depth: int) -> Result:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _Refused(f"only local $ref ('#/...') are supported, got {ref!r}")
        if "~" in ref or "%" in ref:
            raise _Refused(f"$ref {ref!r}: outlines-core does not decode ~ or % escapes")
        if depth > MAX_REF_DEPTH:
            raise _RefLimit()
        target: Any = self.root
        for token in (t for t in ref[2:].split("/") if t):
            if not isinstance(target, dict) or token not in target:
                raise _Refused(f"$ref {ref!r}: outlines-core cannot follow it")
            target = target[token]
        if target == {} and target is not self.root:
            target.update(_any())  # outlines writes a bare {} as an alternation
        size, out = self.walk(target, depth + 1)
        self.flag(node, out, {"$ref"})
        return size, out

    def types(self, node: dict[str, Any], depth: int) -> Result:
        names = node["type"]
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names or any(n not in _TYPES for n in names):
            raise _Refused(f"type must name JSON types, got {node['type']!r}")
        honoured: set[str] = {"type"}
        size, out = 2, frozenset()
        for name in names:
            part = self.type_part(name, node, depth, honoured) + 4
            size, out = size + part, out | ({name} if name != "number" else NUMERIC)
        self.flag(node, out, honoured)
        return size, out

    def type_part(self, name: str, node: dict[str, Any], depth: int, honoured: set[str]) -> int:
        base, w = self.base, self.ws
        if name == "string":
            return self.string_part(node, honoured)
        if name == "array":
            honoured.update({"minItems", "maxItems", "items"})
            if "items" in node:
                honoured.add("unevaluatedItems")  # it sees only items past "items": none
            low, high = _count(node, "minItems"), _count(node, "maxItems", None)
            if high is not None and high < low:
                raise _Refused("minItems above maxItems (outlines-core cannot write it)")
            if high == 0:
                return 6 + w
            if "items" not in node:
                return base["array"]
            return 2 * self.walk(node["items"], depth)[0] + 30 + 3 * w
        if name == "object":
            honoured.add("additionalProperties")
            if "additionalProperties" in node:
                honoured.add("unevaluatedProperties")  # it sees no other property
            low, high = _count(node, "minProperties"), _count(node, "maxProperties", None)
            if high is not None and high < low:
                raise _Refused("minProperties above maxProperties (outlines-core cannot write it)")
            # outlines reads only maxProperties 0 and whether minProperties is 0, and may write
            # a key twice: at least one property is all it promises.
            if low <= 1:
                honoured.add("minProperties")
            if high in (None, 0):
                honoured.add("maxProperties")
            extra = node.get("additionalProperties", True)
            if high == 0:
                return 6 + w
            if extra is True:
                return base["object"]
            return 2 * (self.walk(extra, depth)[0] + base["string"]) + 30 + 6 * w
        return base.get(name, 12)

    def string_part(self, node: dict[str, Any], honoured: set[str]) -> int:
        honoured.update({"minLength", "maxLength", "pattern", "format"})
        if id(node) not in self.strings:
            self.strings[id(node)] = self._string(node)
        return self.strings[id(node)]

    def _string(self, node: dict[str, Any]) -> int:
        """What outlines writes for a string (its pattern rewritten for the JSON text, a
        pattern or format it would not enforce recorded and dropped)."""
        low, high = _count(node, "minLength"), _count(node, "maxLength", None)
        if "minLength" in node or high is not None:
            if high is not None and high < low:
                raise _Refused("minLength above maxLength (outlines-core cannot write it)")
            for other in ("pattern", "format"):
                if other in node:
                    self.unenforced.add(f"{other} (beside minLength/maxLength)")
            # outlines' own bounded string takes escapes inside the counted repetition, which
            # makes its index build exponential in the bound (maxLength 18: 27 s, measured):
            # plain characters only, never a raw control character (fewer instances, all valid).
            bound = "" if high is None else str(high)
            node["pattern"] = f"^{BOUNDED_CHAR}{{{low},{bound}}}$"
            node.pop("minLength", None)
            node.pop("maxLength", None)
            return len(node["pattern"]) + 4
        if "pattern" in node:
            pattern = node["pattern"]
            try:
                if not isinstance(pattern, str):
                    raise PatternRefused("pattern must be a string")
                node["pattern"] = outlines_pattern(pattern)
                if "format" in node:
                    self.unenforced.add("format (beside pattern)")
                return len(node["pattern"]) + 4
            except PatternRefused as exc:
                self.unenforced.add(f"pattern ({exc})")
                del node["pattern"]
        fmt = node.get("format")
        if fmt in _NATIVE_FORMATS:
            return self.base[fmt]
        if fmt is not None:
            self.unenforced.add(f"format ({fmt})")
            del node["format"]
        return self.base["string"]


def _count(node: dict[str, Any], key: str, default: int | None = 0) -> Any:
    """A count keyword's value (``default`` when absent); the walk refuses one outlines would
    not read (a non-integer)."""
    if key not in node:
        return default
    value = node[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Refused(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _check_value(value: Any) -> None:
    """Refuses an enum/const value outlines would write wrongly (object keys it would need to
    escape)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if _UNSAFE_KEY.search(key):
                raise _Refused(f"an enum/const object key outlines-core would not escape: {key!r}")
            _check_value(item)
    elif isinstance(value, list):
        for item in value:
            _check_value(item)


def check_outlines_schema(schema: Any, ws: str = "", open_objects: bool = False) -> OutlinesSchema:
    """The normalised schema outlines-core would be handed for ``schema`` under the object
    policy (closed objects unless ``open_objects``) and what it would not enforce (see the
    module docstring); ``ws`` is the whitespace regex between JSON tokens."""
    if schema is False:
        return OutlinesSchema(None, (), "the schema false matches nothing", 0)
    walk = None
    try:
        normal = _normal_form(schema, open_objects)
        walk = _Walk(normal, ws)
        size, _ = walk.walk(normal, 0)
        unenforced = tuple(sorted(walk.unenforced))
        return OutlinesSchema(normal, unenforced, None, size, _open_with_properties(normal))
    except _RefLimit:
        error = f"a $ref nested more than {MAX_REF_DEPTH + 1} deep outside any property"
    except _Refused as exc:
        error = str(exc)
    except RecursionError:
        error = "schema nesting is too deep"
    unenforced = tuple(sorted(walk.unenforced)) if walk is not None else ()
    return OutlinesSchema(None, unenforced, error, 0)


def _open_with_properties(schema: Any) -> bool:
    """Whether a subschema declares properties and admits other names as well (neither
    ``additionalProperties`` nor ``unevaluatedProperties`` false)."""
    found = False

    def look(node: dict[str, Any], _: Path) -> dict[str, Any]:
        nonlocal found
        found = found or (
            bool(node.get("properties"))
            and node.get("additionalProperties") is not False
            and node.get("unevaluatedProperties") is not False
        )
        return node

    map_schemas(schema, look)
    return found


__all__ = ["MAX_REF_DEPTH", "OutlinesSchema", "check_outlines_schema"]
