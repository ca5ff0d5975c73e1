"""outlines-core's schema rewriting: a schema rewritten into a shape outlines' converter reads
faithfully, and the assertion keywords it would still ignore.

outlines-core's converter reads one keyword per subschema (``properties`` before ``allOf``
before ``anyOf`` ... before ``type``) and drops the rest; it concatenates allOf subschemas,
writes patterns unescaped into the JSON string, and drops required properties when its $ref
recursion limit hits. ``prepare_schema`` merges allOf, pushes anyOf/oneOf siblings into the
branches, inlines every $ref with recursion cut where the schema allows it, translates patterns
to JSON-string level, and makes booleans and bare annotations explicit. Where outlines cannot
say a constraint exactly it writes a narrower one (only listed properties, in schema order; an
object schema without "type" writes objects; bounded strings never hold escape sequences).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from baton.grammar.backend import GrammarError
from baton.grammar.schema.outlines_merge import (
    const_schema,
    cousins_ok,
    json_key,
    merge_schemas,
    pairwise_disjoint,
    wrap_any,
)
from baton.grammar.schema.pattern_regex import SAFE_CHAR, Unsupported, json_string_pattern
from baton.grammar.schema.refs import PointerNotFound, resolve_pointer
from baton.grammar.schema.types import (
    ALL_TYPES,
    ARRAY,
    ASSERTIONS,
    KEYWORD_TYPES,
    NUMERIC,
    OBJECT,
    canon,
    count_value,
    declared_types,
    value_types,
)

# RFC 3339 (outlines' own date-time has no offsets, its time regex can emit a bare backslash).
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]{1,9})?"
_OFFSET = r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}{_OFFSET}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}{_OFFSET}$",
}
# Formats outlines' own regexes handle safely; its email and uri regexes can emit unescaped
# quotes inside the JSON string, so those are treated as the annotations they are by default.
_NATIVE_FORMATS = frozenset({"uuid"})

_MAX_RECURSION = 3
_MAX_NODES = 20_000


_COUNT_KEYWORDS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


def _trivial(keyword: str, value: Any) -> bool:
    """True when the keyword cannot reject anything."""
    if keyword in ("minLength", "minItems", "minProperties", "minContains") and value == 0:
        return True
    if keyword == "uniqueItems" and value is False:
        return True
    if keyword in ("required", "dependentRequired", "dependentSchemas", "dependencies"):
        return not value
    return keyword in ("patternProperties", "properties") and not value


def _is_legacy_draft(root: Any) -> bool:
    schema = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(schema, str) and bool(re.search(r"draft-0[3-7]", schema))


@dataclass(frozen=True)
class PreparedSchema:
    """A schema rewritten for outlines-core's converter.

    Attributes:
        schema: the rewritten schema (JSON-serialisable).
        unenforced: assertion keywords outlines would ignore, sorted.
        error: why outlines cannot take the schema at all, or None.
    """

    schema: Any
    unenforced: tuple[str, ...]
    error: str | None


class _Preparer:
    """One rewriting pass over a schema (see the module docstring)."""

    def __init__(self, root: Any, disable_additional_properties: bool) -> None:
        self.root = root
        self.disable_additional = disable_additional_properties
        self.legacy_ref = _is_legacy_draft(root)
        self.root_id = (root.get("$id") or root.get("id")) if isinstance(root, dict) else None
        self.unenforced: set[str] = set()
        # $ref targets being expanded (outlines' own $ref handling drops a required property
        # when it hits its recursion limit, so every $ref is inlined here, cut soundly).
        self.expanding: list[str] = []
        self.nodes = 0

    # -- references --
    def _pointer(self, ref: Any) -> str:
        if not isinstance(ref, str):
            raise Unsupported("$ref must be a string")
        base, sep, fragment = ref.partition("#")
        if base and base != self.root_id:
            raise Unsupported(f"only local $ref are supported, got {ref!r}")
        if fragment and not fragment.startswith("/"):
            raise Unsupported(f"$ref to an anchor is not supported: {ref!r}")
        return fragment

    def _resolve(self, pointer: str) -> Any:
        try:
            return resolve_pointer(self.root, pointer)
        except PointerNotFound:
            raise Unsupported(f"$ref target not found: #{pointer}") from None

    def _inline(self, node: Any) -> tuple[Any, str | None]:
        """A subschema with a local $ref replaced by its target merged with the $ref's siblings
        (None: they cannot be merged; False: the recursion limit cuts here)."""
        if node is True:
            return {}, None
        if isinstance(node, dict) and "$ref" in node:
            pointer = self._pointer(node["$ref"])
            if self.expanding.count(pointer) >= _MAX_RECURSION:
                return False, None
            target = self._resolve(pointer)
            if target is True:
                target = {}
            if target is False:
                return False, None
            if not isinstance(target, dict):
                raise Unsupported(f"$ref target #{pointer} is not a schema")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            if self.legacy_ref:
                rest = {k: v for k, v in rest.items() if k not in ASSERTIONS}
            if not cousins_ok([rest, target]):
                return None, pointer
            return merge_schemas(target, rest), pointer
        return node, None

    # -- merging (allOf, siblings of anyOf/oneOf/$ref) --
    def _merge_all(self, parts: list[Any]) -> Any:
        """Merges a parent (``parts[0]``) with applicator members (allOf entries, one anyOf or
        oneOf branch) into one prepared schema; None when the merge cannot be said, False when
        nothing matches."""
        merged: dict[str, Any] = {}
        pushed: list[str] = []
        try:
            inlined = []
            for part in parts:
                if part is False:
                    return False
                part, pointer = self._inline(part)
                if part is None or part is False:
                    return part
                if pointer is not None:
                    self.expanding.append(pointer)
                    pushed.append(pointer)
                inlined.append(part)
            if not cousins_ok(inlined):
                return None
            for part in inlined:
                result = merge_schemas(merged, part)
                if result is None:
                    return None
                merged = result
            return self.prep_dict(merged)
        finally:
            for _ in pushed:
                self.expanding.pop()

    # -- the walk --
    def run(self) -> PreparedSchema:
        try:
            root = self.root
            if root is False:
                raise Unsupported("the schema false matches nothing")
            prepared = self.prep(root)
            if prepared is False:
                raise Unsupported(
                    "the schema matches nothing (within the recursion limit of "
                    f"{_MAX_RECURSION} nested uses of one $ref)"
                )
            return PreparedSchema(
                wrap_any(prepared, top=True), tuple(sorted(self.unenforced)), None
            )
        except Unsupported as exc:
            return PreparedSchema(None, tuple(sorted(self.unenforced)), str(exc))
        except GrammarError as exc:
            return PreparedSchema(None, tuple(sorted(self.unenforced)), str(exc))
        except RecursionError:
            return PreparedSchema(None, (), "schema nesting is too deep")

    def prep(self, node: Any) -> Any:
        """The rewritten subschema, or False when it matches nothing."""
        if node is True:
            return {}
        if node is False:
            return False
        if not isinstance(node, dict):
            raise Unsupported(f"a subschema must be an object or a boolean, got {node!r}")
        return self.prep_dict(dict(node))

    def flag(self, node: dict[str, Any], out_types: frozenset[str], honoured: set[str]) -> None:
        """Reports the assertion keywords of ``node`` outlines ignores here."""
        for key, value in node.items():
            if key not in ASSERTIONS or key in honoured or _trivial(key, value):
                continue
            if key in ("then", "else") and "if" not in node:
                continue
            if key == "if" and "then" not in node and "else" not in node:
                continue
            if key in ("minContains", "maxContains") and "contains" not in node:
                continue
            if key == "format":
                continue
            if KEYWORD_TYPES[key] & out_types:
                self.unenforced.add(key)

    def prep_dict(self, node: dict[str, Any]) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise Unsupported(
                f"the schema expands to more than {_MAX_NODES} subschemas once its $ref are "
                "inlined: too large for outlines-core"
            )
        for key in _COUNT_KEYWORDS:
            if key in node and (count := count_value(node[key])) is not None:
                node[key] = count
        if self.legacy_ref and "$ref" in node:
            node = {k: v for k, v in node.items() if k == "$ref" or k not in ASSERTIONS}
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            node.pop("additionalItems", None)
        node.pop("additionalItems", None)
        if "allOf" in node:
            members = node.pop("allOf")
            if not isinstance(members, list):
                raise Unsupported("allOf must be an array")
            merged = self._merge_all([node, *members])
            if merged is False:
                return False
            if merged is None:
                raise Unsupported(
                    "allOf: outlines-core concatenates allOf subschemas, and these could not be "
                    "merged into one schema"
                )
            return merged
        for key in ("anyOf", "oneOf"):
            if key in node:
                return self.prep_alternatives(node, key)
        if "$ref" in node:
            return self.prep_ref(node)
        if "properties" in node:
            return self.prep_properties(node)
        if "prefixItems" in node:
            return self.prep_prefix_items(node)
        if "enum" in node or "const" in node:
            return self.prep_enum(node)
        if "type" in node:
            return self.prep_type(node)
        families = {
            KEYWORD_TYPES[k] for k, v in node.items() if k in ASSERTIONS and not _trivial(k, v)
        }
        if len(families) == 1 and next(iter(families)) != ALL_TYPES:
            # Keywords of one type only: write that type (outlines does the same for
            # properties); other types would satisfy the schema too, so this only narrows.
            family = next(iter(families))
            return self.prep_dict({**node, "type": "number" if family == NUMERIC else min(family)})
        self.flag(node, ALL_TYPES, set())
        return {}

    def prep_alternatives(self, node: dict[str, Any], key: str) -> Any:
        branches = node.pop(key)
        if not isinstance(branches, list) or not branches:
            raise Unsupported(f"{key} must be a non-empty array")
        siblings = {k: v for k, v in node.items() if k in ASSERTIONS}
        out: list[Any] = []
        for branch in branches:
            if siblings:
                merged = self._merge_all([siblings, branch])
                if merged is None:
                    self.flag(siblings, ALL_TYPES, set())
                    merged = self.prep(branch)
            else:
                merged = self.prep(branch)
            if merged is not False:
                out.append(merged)
        if not out:
            return False
        if key == "oneOf" and len(out) > 1 and not pairwise_disjoint(out):
            self.unenforced.add("oneOf")
        if len(out) == 1:
            return out[0]
        if any(b == {} for b in out):
            return {}
        return {"anyOf": out}

    def prep_ref(self, node: dict[str, Any]) -> Any:
        siblings = {k: v for k, v in node.items() if k in ASSERTIONS and k != "$ref"}
        if siblings:
            merged = self._merge_all([node])
            if merged is not None:
                return merged
            self.flag(siblings, ALL_TYPES, set())
        pointer = self._pointer(node["$ref"])
        if self.expanding.count(pointer) >= _MAX_RECURSION:
            return False  # recursion cut: this value is not written (its parent decides)
        self.expanding.append(pointer)
        try:
            return self.prep(self._resolve(pointer))
        finally:
            self.expanding.pop()

    def prep_properties(self, node: dict[str, Any]) -> Any:
        types = declared_types(node)
        if "object" not in types:
            # Only non-objects are allowed, and object keywords say nothing about them.
            node = {k: v for k, v in node.items() if KEYWORD_TYPES.get(k) != OBJECT}
            return self.prep_dict(node)
        if "type" in node and types != OBJECT:
            # outlines writes only the object: the other types become their own branch.
            raw = node["type"]
            others = [t for t in ([raw] if isinstance(raw, str) else raw) if t != "object"]
            object_part = {**node, "type": "object"}
            rest = {k: v for k, v in node.items() if KEYWORD_TYPES.get(k) != OBJECT}
            rest["type"] = others
            return self.prep_alternatives({"anyOf": [object_part, rest]}, "anyOf")
        props_in = node.get("properties", {})
        if not isinstance(props_in, dict):
            raise Unsupported("properties must be an object")
        required = [r for r in node.get("required", []) if isinstance(r, str)]
        additional = node.get("additionalProperties", True)
        if self.disable_additional and "additionalProperties" not in node:
            additional = False
        props: dict[str, Any] = {}
        for name, sub in props_in.items():
            prepared = self.prep(sub)
            if prepared is False:
                if name in required:
                    return False
                continue
            props[name] = prepared
        for name in required:
            if name in props:
                continue
            if additional is False and "additionalProperties" in node:
                return False  # a required property the schema does not allow
            # outlines only writes listed properties: list the missing required ones.
            prepared = self.prep(additional) if isinstance(additional, dict) else {}
            if prepared is False:
                return False
            props[name] = prepared
        honoured = {
            "properties",
            "required",
            "additionalProperties",
            "unevaluatedProperties",
            "type",
        }
        n_required = len(set(required))
        if node.get("minProperties", 0) <= n_required:
            honoured.add("minProperties")
        if isinstance(node.get("maxProperties"), int) and node["maxProperties"] >= len(props):
            honoured.add("maxProperties")
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and not any(
            _py_search(p, name) for p in patterns for name in props
        ):
            honoured.add("patternProperties")
        self.flag(node, OBJECT, honoured)
        # outlines regex-escapes names but does not JSON-escape them: hand it the JSON text.
        out: dict[str, Any] = {
            "type": "object",
            "properties": {json_key(k): v for k, v in props.items()},
        }
        if required:
            out["required"] = [json_key(r) for r in dict.fromkeys(required) if r in props]
        return out

    def prep_prefix_items(self, node: dict[str, Any]) -> Any:
        types = declared_types(node)
        if "array" not in types:
            node = {k: v for k, v in node.items() if KEYWORD_TYPES.get(k) != ARRAY}
            return self.prep_dict(node)
        items = node["prefixItems"]
        if not isinstance(items, list):
            raise Unsupported("prefixItems must be an array")
        prepared = [self.prep(i) for i in items]
        if any(p is False for p in prepared):
            return False
        honoured = {"prefixItems", "items", "type", "unevaluatedItems"}
        if node.get("minItems", 0) <= len(items):
            honoured.add("minItems")
        if node.get("maxItems", len(items)) >= len(items):
            honoured.add("maxItems")
        self.flag(node, ARRAY, honoured)
        return {"prefixItems": prepared}

    def prep_enum(self, node: dict[str, Any]) -> Any:
        if "enum" in node:
            values = node["enum"]
            if not isinstance(values, list) or not values:
                raise Unsupported("enum must be a non-empty array")
        else:
            values = [node["const"]]
        if "enum" in node and "const" in node:
            keep = canon(node["const"])
            values = [v for v in values if canon(v) == keep]
        types = declared_types(node)
        values = [v for v in values if value_types(v) & types]
        if not values:
            return False
        out_types = frozenset().union(*(value_types(v) for v in values))
        self.flag(node, out_types, {"enum", "const", "type"})
        scalars = [v for v in values if not isinstance(v, (dict, list))]
        # outlines' enum takes scalars only: objects and arrays become exact schemas.
        parts = [const_schema(v) for v in values if isinstance(v, (dict, list))]
        if scalars:
            parts.insert(0, {"enum": scalars})
        return parts[0] if len(parts) == 1 else {"anyOf": parts}

    def prep_type(self, node: dict[str, Any]) -> Any:
        raw = node["type"]
        names = [raw] if isinstance(raw, str) else raw
        if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
            raise Unsupported("type must be a string or an array of strings")
        unknown = [t for t in names if t not in ALL_TYPES]
        if unknown:
            raise Unsupported(f"unknown type {unknown[0]!r}")
        names = list(dict.fromkeys(names))
        if "number" in names and "integer" in names:
            names.remove("integer")
        honoured: set[str] = {"type"}
        parts: list[Any] = []
        for t in names:
            part = self._type_part(t, node, honoured)
            if part is not False:
                parts.append(part)
        self.flag(node, declared_types(node), honoured)
        if not parts:
            return False
        return parts[0] if len(parts) == 1 else {"anyOf": parts}

    def _type_part(self, t: str, node: dict[str, Any], honoured: set[str]) -> Any:
        if t == "string":
            return self._string_part(node, honoured)
        if t == "array":
            honoured.update({"items", "minItems", "maxItems", "unevaluatedItems"})
            out: dict[str, Any] = {"type": "array"}
            # With no items keyword, unevaluatedItems applies to every item, like items.
            items = node.get("items", node.get("unevaluatedItems", True))
            prepared = self.prep(items)
            min_items, max_items = node.get("minItems", 0), node.get("maxItems")
            if prepared is False:
                if min_items > 0:
                    return False
                max_items = 0
            elif items is not True:
                out["items"] = prepared
            if isinstance(min_items, int) and min_items > 0:
                out["minItems"] = min_items
            if isinstance(max_items, int):
                if max_items < min_items:
                    return False
                out["maxItems"] = max_items
            return out
        if t == "object":
            additional = node.get("additionalProperties", True)
            if "additionalProperties" not in node and "patternProperties" not in node:
                # With nothing else evaluating properties, unevaluatedProperties is
                # additionalProperties.
                additional = node.get("unevaluatedProperties", True)
                honoured.add("unevaluatedProperties")
            if self.disable_additional and "additionalProperties" not in node:
                additional = False
            if additional is False or node.get("required"):
                # An object with only (required) listed properties is what outlines writes.
                honoured.update(k for k, v in KEYWORD_TYPES.items() if v == OBJECT)
                closed = {**node, "type": "object", "properties": {}}
                if additional is not True:
                    closed["additionalProperties"] = additional
                return self.prep_properties(closed)
            honoured.update({"additionalProperties"})
            if node.get("minProperties", 0) <= 1:
                honoured.add("minProperties")
            if node.get("maxProperties") == 0:
                honoured.add("maxProperties")
            out = {"type": "object"}
            if additional is not True:
                prepared = self.prep(additional)
                if prepared is not False and prepared != {}:
                    out["additionalProperties"] = prepared
            if node.get("minProperties", 0) >= 1:
                out["minProperties"] = 1
            if node.get("maxProperties") == 0:
                out["maxProperties"] = 0
            return out
        return {"type": t}

    def _string_part(self, node: dict[str, Any], honoured: set[str]) -> Any:
        honoured.update({"minLength", "maxLength"})
        low, high = node.get("minLength"), node.get("maxLength")
        if low is not None or high is not None:
            lo = int(low) if isinstance(low, (int, float)) else 0
            hi = "" if high is None else str(int(high))
            if high is not None and int(high) < lo:
                return False
            return {"type": "string", "pattern": f"{SAFE_CHAR}{{{lo},{hi}}}"}
        if "pattern" in node:
            honoured.add("pattern")
            if not isinstance(node["pattern"], str):
                raise Unsupported("pattern must be a string")
            return {"type": "string", "pattern": json_string_pattern(node["pattern"])}
        fmt = node.get("format")
        if fmt in _FORMAT_PATTERNS:
            return {"type": "string", "pattern": json_string_pattern(_FORMAT_PATTERNS[fmt])}
        if fmt in _NATIVE_FORMATS:
            return {"type": "string", "format": fmt}
        return {"type": "string"}


def _py_search(pattern: str, text: str) -> bool:
    """Whether an ECMA pattern may match ``text`` (Python's re as the approximation; a pattern
    Python cannot read counts as matching, the cautious answer)."""
    try:
        return re.search(pattern, text) is not None
    except (re.error, TypeError):
        return True


def prepare_schema(schema: Any, disable_additional_properties: bool = False) -> PreparedSchema:
    """Rewrites ``schema`` for outlines-core's converter and lists what it would not enforce.

    Returns a ``PreparedSchema``; its ``error`` says why outlines cannot take the schema at all
    (the schema false, allOf it cannot merge, a pattern its DFA cannot express...).
    """
    return _Preparer(schema, disable_additional_properties).run()


def outlines_unenforced_keywords(schema: Any) -> set[str]:
    """Assertion keywords present in ``schema`` (reachable subschemas, $ref followed) that
    outlines-core would not enforce; see ``OUTLINES_UNENFORCED_KEYWORDS`` and
    ``OUTLINES_CONDITIONAL_KEYWORDS``."""
    return set(prepare_schema(schema).unenforced)


__all__ = ["PreparedSchema", "outlines_unenforced_keywords", "prepare_schema"]
