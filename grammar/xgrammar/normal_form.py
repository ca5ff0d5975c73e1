"""The schema baton hands xgrammar: the same instances, in forms xgrammar compiles whole and
fills fast (``xgrammar_normal_form``). Each rewrite says why beside it; the keyword table that
decides what xgrammar enforces is ``keywords``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from baton.grammar.schema.merge import cousins_ok, merge_schemas
from baton.grammar.schema.normalise import (
    Path,
    integral_counts,
    map_schemas,
    object_policy,
    open_object_schemas,
    uses_keyword,
)
from baton.grammar.schema.pattern_regex import outside_classes, split_top_level
from baton.grammar.schema.refs import (
    inside_a_target,
    is_local_ref,
    ref_target_paths,
    resolve_local_ref,
)
from baton.grammar.xgrammar.keywords import (
    DEPENDENT_KEYWORDS,
    DOMINANT_ORDER,
    TYPE_KEYWORDS,
    VALIDATING_KEYWORDS,
    XGRAMMAR_ENFORCED_FORMATS,
    XGRAMMAR_UNENFORCED_FORMATS,
    XGRAMMAR_UNENFORCED_KEYWORDS,
)

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

# RFC 3986's URI-reference: a URI (scheme ":" hier-part) or a relative reference, each with
# an optional query and fragment. xgrammar's own uri-reference grammar (0.2.9) takes relative
# references only: "https://example.com/a" was rejected. Characters outside RFC 3986's sets
# (space, quotes, backslash, "<", ">", "{", "}") and a "%" without two hex digits are not URI text.
_HEX2 = r"%[0-9A-Fa-f]{2}"
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|" + _HEX2 + ")"
_SEGMENT_NC = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=@]|" + _HEX2 + ")+"  # first segment, no scheme
_SEGMENTS = r"(?:/" + _PCHAR + r"*)*"
_HOST = (
    r"(?:\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+)\]"
    r"|(?:[A-Za-z0-9\-._~!$&'()*+,;=]|" + _HEX2 + r")*)"
)
_AUTHORITY = r"(?:(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|" + _HEX2 + r")*@)?" + _HOST + r"(?::[0-9]*)?"
_SCHEME = r"[A-Za-z][A-Za-z0-9+\-.]*:"
_PATH_ABSOLUTE = r"/(?:" + _PCHAR + r"+" + _SEGMENTS + r")?"
_HIER_PARTS = (
    r"(?:" + _SCHEME + r")?(?://" + _AUTHORITY + _SEGMENTS + r"|" + _PATH_ABSOLUTE + r")",
    _SCHEME + r"(?:" + _PCHAR + r"+" + _SEGMENTS + r")?",  # rootless, or empty, after a scheme
    r"(?:" + _SEGMENT_NC + _SEGMENTS + r")?",  # relative path, or empty
)
_QUERY_FRAGMENT = r"(?:\?(?:" + _PCHAR + r"|[/?])*)?(?:#(?:" + _PCHAR + r"|[/?])*)?"
URI_REFERENCE_PATTERN = r"^(?:" + "|".join(_HIER_PARTS) + r")" + _QUERY_FRAGMENT + r"$"
_FORMAT_PATTERNS = {"uri-template": URI_TEMPLATE_PATTERN, "uri-reference": URI_REFERENCE_PATTERN}

# Every JSON type once ("number" covers "integer"), in the order the rest branch lists them.
_JSON_TYPES = ("null", "boolean", "number", "string", "array", "object")
_DEFINED_FORMATS = XGRAMMAR_ENFORCED_FORMATS | XGRAMMAR_UNENFORCED_FORMATS


# Keywords from which xgrammar infers a type when a schema has none: it then builds the
# schema for that type alone (``{"properties": ...}`` only as objects), where JSON Schema
# applies them to that type and lets every other value through.
_INFERRING: dict[str, tuple[str, ...]] = {
    "object": ("properties", "additionalProperties", "unevaluatedProperties"),
    "array": ("items", "prefixItems", "unevaluatedItems"),
}
_SPLIT_KEYWORDS: dict[str, tuple[str, ...]] = {
    family: (*keywords, *_INFERRING.get(family, ())) for family, keywords in TYPE_KEYWORDS.items()
}
_SPLIT = frozenset(k for keywords in _SPLIT_KEYWORDS.values() for k in keywords)


def _typed_split(node: dict[str, Any]) -> dict[str, Any] | None:
    """An untyped schema with type-specific keywords as an ``anyOf`` of one branch per type
    family that its keywords constrain, plus one for every other type; None when it has a
    type or a dominant keyword, or no type-specific keyword.

    xgrammar builds such a schema as "any value" and drops those keywords (``"minLength (no
    type)"``), or, for the object and array keywords it infers a type from (``_INFERRING``),
    as that type alone; JSON Schema applies each keyword to its own type only, which the
    branches say.
    """
    if "type" in node or any(k in node for k in DOMINANT_ORDER):
        return None
    families = [
        family
        for family, keywords in _SPLIT_KEYWORDS.items()
        if any(k in node and (k != "format" or node[k] in _DEFINED_FORMATS) for k in keywords)
    ]
    if not families:
        return None
    branches: list[Any] = [
        {"type": family, **{k: node[k] for k in _SPLIT_KEYWORDS[family] if k in node}}
        for family in families
    ]
    rest = [t for t in _JSON_TYPES if t not in families]
    if rest:
        branches.append({"type": rest})
    return {**{k: v for k, v in node.items() if k not in _SPLIT}, "anyOf": branches}


# Keywords xgrammar's walk reports wherever they appear: a merge may keep either copy.
_KEEP_ONE = frozenset(XGRAMMAR_UNENFORCED_KEYWORDS) | DEPENDENT_KEYWORDS
_APPLICATORS = ("anyOf", "oneOf", "allOf", "$ref", "$dynamicRef", "$recursiveRef")
_MERGE_ROUNDS = 4


def _merged_all_of(node: dict[str, Any], root: Any) -> dict[str, Any] | None:
    """A schema with an ``allOf`` as the one schema its members and siblings say together
    (``merge.merge_schemas``, a member that is only a local ``$ref`` read as its
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
            extra = {k for k in member if k in VALIDATING_KEYWORDS} - {"$ref"}
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


# Keywords that could admit or judge a property name beside ``properties``.
_OTHER_NAME_KEYWORDS = frozenset(
    {
        "patternProperties",
        "unevaluatedProperties",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
    }
)


# Keywords beside which an object without additionalProperties is left as strict mode reads it.
_CLOSED_OBJECT_KEYWORDS = frozenset(
    {"additionalProperties", "unevaluatedProperties", "patternProperties", "propertyNames"}
)


def _mentions(tree: Any, keyword: str) -> bool:
    """Whether ``keyword`` is a key anywhere in ``tree`` (a property named so counts too: the
    cautious answer)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if keyword in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


# Any text at all (ECMA's "." leaves out line terminators), for a pattern's unanchored side.
_ANY_TEXT = r"[\s\S]*"
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def _inner_anchor(branch: str) -> bool:
    """Whether ``branch`` has a ``^`` or ``$`` outside a class (escapes skipped)."""
    return any(branch[i] in "^$" for i in outside_classes(branch))


def anchored_search(pattern: str) -> str | None:
    r"""JSON Schema's ``pattern`` (an ECMA-262 search: it may match anywhere in the string) as
    the regex xgrammar reads (which must match the whole string): each unanchored side of a
    top-level branch gets any text (``^a`` as ``^(?:(?:a)[\s\S]*)$``). None when there is
    nothing to do (every branch anchored at both ends) or the pattern is left as it is: a
    ``(?`` group other than ``(?:`` (lookarounds are reported), an anchor inside a branch, or
    a count past 128 (``patterns`` rebuilds those from the pattern as written).
    """
    if "(?" in pattern.replace("(?:", "") or any(
        int(n) > 128 for m in _COUNT.finditer(pattern) for n in m.groups() if n
    ):
        return None
    branches = []
    for branch in split_top_level(pattern):
        start = branch.startswith("^")
        branch = branch[1:] if start else branch
        end = branch.endswith("$") and (len(branch) - 1 - len(branch[:-1].rstrip("\\"))) % 2 == 0
        branch = branch[:-1] if end else branch
        if _inner_anchor(branch):
            return None
        branches.append((start, branch, end))
    if all(start and end for start, _, end in branches):
        return None
    written = [
        ("" if start else _ANY_TEXT) + f"(?:{branch})" + ("" if end else _ANY_TEXT)
        for start, branch, end in branches
    ]
    return "^(?:" + "|".join(written) + ")$"


def counted_optional_groups(pattern: str) -> str:
    """``pattern`` with each optional group ``(...)?`` (or lazy ``(...)??``) written
    ``(...){0,1}``, the same language.

    xgrammar (0.2.9) misreads an optional group inside a JSON-schema ``pattern`` (its
    ``json_string`` regex path; ``Grammar.from_regex`` reads it right): ``^(?:xa*)?$`` accepted
    "a", as if it were ``x?a*``. A differential run of random patterns against Python's ``re``
    (every string up to 4 characters) found 24 of 300 patterns misread this way, and none once
    optional groups were counted.
    """
    out, start = [], 0
    for i in outside_classes(pattern):
        if pattern[i] == ")" and pattern.startswith("?", i + 1):
            out.append(pattern[start:i] + "){0,1}")
            start = i + (3 if pattern.startswith("??", i + 1) else 2)
    out.append(pattern[start:])
    return "".join(out)


def _xgrammar_pattern(pattern: str) -> str:
    """A ``pattern`` (or patternProperties key) as xgrammar is handed it, the same language:
    the search made whole-string (``anchored_search``), optional groups counted."""
    return counted_optional_groups(anchored_search(pattern) or pattern)


@dataclass(frozen=True)
class _Context:
    """What every rewrite reads of the schema as it was handed in (before any rewrite): its
    root (for ``$ref`` targets), the paths its ``$ref``s point at, and whether it has an
    ``unevaluatedProperties`` or ``unevaluatedItems`` anywhere."""

    root: dict[str, Any]
    targets: set[Path]
    cousins_judge_names: bool
    cousins_judge_items: bool

    def pointed_into(self, path: Path, keys: Iterable[str]) -> bool:
        """Whether a $ref points at or below one of the node's ``keys``."""
        return any(
            inside_a_target((*path, key), self.targets) or (*path, key) in self.targets
            for key in keys
        )


_NodeRewrite = Callable[[_Context, dict[str, Any], Path], dict[str, Any]]


def _merge(ctx: _Context, node: dict[str, Any], path: Path) -> dict[str, Any]:
    # A merge moves what lies below the node, but its definitions: a $ref into it would
    # break.
    if "allOf" not in node or ctx.pointed_into(path, node.keys() - {"$defs", "definitions"}):
        return node
    merged = _merged_all_of(node, ctx.root)
    return node if merged is None else merged


def _draft_forms(ctx: _Context, node: dict[str, Any], path: Path) -> dict[str, Any]:
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
        if ctx.pointed_into(path, ("items", "additionalItems")):
            return out
        out = {k: v for k, v in out.items() if k not in ("items", "additionalItems")}
        out["prefixItems"] = items
        out["items"] = node.get("additionalItems", True)
    return out


def _fast_format(_ctx: _Context, node: dict[str, Any], _path: Path) -> dict[str, Any]:
    fmt = node.get("format")
    if not isinstance(fmt, str) or fmt not in _FORMAT_PATTERNS or "pattern" in node:
        return node
    return {
        **{k: v for k, v in node.items() if k != "format"},
        "pattern": _FORMAT_PATTERNS[fmt],
    }


def _search_patterns(ctx: _Context, node: dict[str, Any], path: Path) -> dict[str, Any]:
    # xgrammar matches a pattern (and a patternProperties key) against the whole string;
    # JSON Schema searches for it anywhere ("^v" admits "vroom").
    out = node
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        written = _xgrammar_pattern(pattern)
        if written != pattern:
            out = {**out, "pattern": written}
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and not ctx.pointed_into(path, ("patternProperties",)):
        keys = {p: _xgrammar_pattern(p) for p in patterns}
        if keys != {p: p for p in patterns} and len(set(keys.values())) == len(keys):
            out = {**out, "patternProperties": {keys[p]: v for p, v in patterns.items()}}
    return out


def _type_into_branches(ctx: _Context, node: dict[str, Any], path: Path) -> dict[str, Any]:
    # {"type": "object", "anyOf": [{"properties": ...}]}: the branch is read under its
    # parent's type, which xgrammar drops beside anyOf/oneOf. Written into each untyped
    # branch (the same instances: the parent asks for the type anyway), the split below
    # does not give such a branch the other types back.
    types = node.get("type")
    out = node
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if types is None or not isinstance(branches, list) or ctx.pointed_into(path, (key,)):
            continue
        typed = [
            {"type": types, **b}
            if isinstance(b, dict)
            and "type" not in b
            and not any(k in b for k in DOMINANT_ORDER)
            and b.keys() & _SPLIT
            else b
            for b in branches
        ]
        if typed != branches:
            out = {**out, key: typed}
    return out


def _split(ctx: _Context, node: dict[str, Any], path: Path) -> dict[str, Any]:
    # Property names are strings: xgrammar reads propertyNames' keywords as string ones.
    if ctx.pointed_into(path, node.keys() & _SPLIT) or path[-1:] == ("propertyNames",):
        return node
    typed = _typed_split(node)
    return node if typed is None else typed


def _absent_properties(ctx: _Context, node: dict[str, Any], path: Path) -> dict[str, Any]:
    # A property whose schema is false may not appear; xgrammar refuses a false schema
    # ("Schema 'false' cannot accept any value"). Where nothing else could admit that name
    # (no additionalProperties but false - strict mode reads absent as false - and no
    # keyword that looks at other names), leaving it undeclared says the same. A required
    # one makes every object invalid: left for xgrammar to refuse.
    props = node.get("properties")
    if not isinstance(props, dict) or not any(v is False for v in props.values()):
        return node
    required = node.get("required")
    required = set(required) if isinstance(required, list) else set()
    if (
        node.get("additionalProperties", False) is not False
        or node.keys() & _OTHER_NAME_KEYWORDS
        or any(v is False and k in required for k, v in props.items())
        or ctx.pointed_into(path, ("properties",))
    ):
        return node
    return {**node, "properties": {k: v for k, v in props.items() if v is not False}}


def _open_objects(ctx: _Context, node: dict[str, Any], _path: Path) -> dict[str, Any]:
    # Without additionalProperties any other name is allowed, with any value, but
    # xgrammar's strict mode reads it as false: only the declared properties ({} when
    # none). additionalProperties: {} is what the schema says. Written only where no
    # property is declared: beside declared names xgrammar spells "any other name" as a
    # rule per character of every declared name, and compiling those took 10-40x longer
    # on large SchemaStore schemas (component-detection-manifest 0.6 s -> 16 s, detekt
    # past 30 s), so such an object stays closed. Left closed too (a narrowing, never a
    # widening): beside patternProperties (xgrammar would then ignore the
    # patterns), propertyNames (strict mode already admits other names there), a dominant
    # keyword (xgrammar ignores its siblings), and wherever unevaluatedProperties could
    # see the change: it sees which names its cousins evaluated, and an additionalProperties
    # written below it would evaluate every name and switch it off. (Beside declared names
    # xgrammar's other names would also let a declared name that JSON escapes, "foo\nbar",
    # in again as another name, with any value.)
    types = node.get("type")
    if (
        ctx.cousins_judge_names
        or (types != "object" and not (isinstance(types, list) and "object" in types))
        or node.keys() & _CLOSED_OBJECT_KEYWORDS
        or any(k in node for k in DOMINANT_ORDER)
        or node.get("properties")
    ):
        return node
    return {**node, "additionalProperties": {}}


def _open_items(ctx: _Context, node: dict[str, Any], _path: Path) -> dict[str, Any]:
    # Without items any item is allowed (past the prefixItems, if any), but xgrammar's
    # strict mode reads it as no item at all: [] only (the prefix only), and no grammar at
    # all beside minItems. items: {} is what the schema says (it fills fast: 12 us per row
    # at worst, measured). Not beside unevaluatedItems, which items would switch off, nor
    # after prefixItems where an unevaluatedItems elsewhere could see the change.
    types = node.get("type")
    if (
        (types != "array" and not (isinstance(types, list) and "array" in types))
        or node.keys() & {"items", "unevaluatedItems"}
        or ("prefixItems" in node and ctx.cousins_judge_items)
    ):
        return node
    return {**node, "items": {}}


# Applied once each, in this order, after the merges.
_REWRITES: tuple[_NodeRewrite, ...] = (
    _draft_forms,
    _fast_format,
    _search_patterns,
    _type_into_branches,
    _split,
    _open_objects,
    _absent_properties,
    _open_items,
)


def _apply(ctx: _Context, rewrite: _NodeRewrite, tree: Any) -> tuple[Any, bool]:
    """``tree`` with ``rewrite`` applied to every subschema, and whether any changed (a
    rewrite returns the node itself where it changes nothing)."""
    changed = False

    def tracked(node: dict[str, Any], path: Path) -> dict[str, Any]:
        nonlocal changed
        out = rewrite(ctx, node, path)
        changed = changed or out is not node
        return out

    return map_schemas(tree, tracked), changed


def xgrammar_normal_form(schema: Any) -> Any:
    """``schema`` in the shape baton hands xgrammar, with the same instances: integral counts
    as ints, every ``allOf`` merged into one schema where it can be (``_merged_all_of``,
    repeated for the allOfs a merge writes), a boolean ``propertyNames`` and drafts 4-2019's
    tuple ``items`` in the forms xgrammar takes, a property whose schema is false left
    undeclared where nothing else admits its name, formats xgrammar fills slowly written as the
    equivalent ``pattern`` (``_FORMAT_PATTERNS``, where no pattern is there already), and
    every untyped subschema with type-specific keywords (or keywords xgrammar infers a type
    from) split by type (``_typed_split``), an object without ``additionalProperties`` given
    ``additionalProperties: {}`` where that says the same (``_open_objects``; strict mode would
    allow no other name), and an array without ``items`` given ``items: {}`` (strict mode
    would allow no item); a subschema a ``$ref`` points inside is left alone. ``schema``
    itself when nothing changes."""
    schema = integral_counts(schema)
    if not isinstance(schema, dict):
        return schema
    ctx = _Context(
        root=schema,
        targets=ref_target_paths(schema),
        cousins_judge_names=_mentions(schema, "unevaluatedProperties"),
        cousins_judge_items=_mentions(schema, "unevaluatedItems"),
    )
    out, any_change = schema, False
    for _ in range(_MERGE_ROUNDS):  # a merge may write new allOfs (a property in both)
        out, changed = _apply(ctx, _merge, out)
        any_change = any_change or changed
        if not changed:
            break
    for rewrite in _REWRITES:
        out, changed = _apply(ctx, rewrite, out)
        any_change = any_change or changed
    return out if any_change else schema


def xgrammar_policy_form(schema: Any, open_objects: bool) -> Any:
    """``schema`` under the request's object policy, in xgrammar's normal form. Strict mode
    reads an absent ``additionalProperties`` as false, so closed objects are written out
    (``object_policy``) and so are open ones (``open_object_schemas``: additionalProperties
    {}, what JSON Schema reads there; check ``open_objects_refusal`` first), the objects that
    declare no names included."""
    schema = object_policy(schema, open_objects)
    # Closed, the objects that declare no names stay open (close_object_schemas), written out
    # here too; beside an unevaluatedProperties that would switch it off, so they stay closed.
    if open_objects or not uses_keyword(schema, "unevaluatedProperties"):
        schema = open_object_schemas(schema)
    return xgrammar_normal_form(schema)


def open_objects_refusal(schema: Any) -> str | None:
    """Why xgrammar cannot write ``schema``'s open objects exactly, or None. Beside an
    ``unevaluatedProperties`` the written-out ``additionalProperties: {}`` would evaluate
    every name and so switch it off; and xgrammar's rule for the other names excludes a
    declared name by its plain spelling only, so one that JSON escapes ("a\\nb") would come
    in again as another name, with any value (both wider than the schema)."""
    if uses_keyword(schema, "unevaluatedProperties"):
        return (
            "xgrammar cannot honour open_objects in a schema that uses unevaluatedProperties "
            "(use closed objects)"
        )
    escaped: list[str] = []

    def look(node: dict[str, Any], _: Path) -> dict[str, Any]:
        props = node.get("properties")
        if isinstance(props, dict):
            escaped.extend(k for k in props if json.dumps(k, ensure_ascii=False)[1:-1] != k)
        return node

    map_schemas(schema, look)
    if escaped:
        return (
            "xgrammar cannot honour open_objects beside property names that JSON escapes "
            f"({', '.join(map(repr, escaped[:3]))}): they would also match as other names "
            "(use the guidance backend, or closed objects)"
        )
    return None


__all__ = [
    "URI_REFERENCE_PATTERN",
    "URI_TEMPLATE_PATTERN",
    "anchored_search",
    "counted_optional_groups",
    "open_objects_refusal",
    "xgrammar_normal_form",
    "xgrammar_policy_form",
]
