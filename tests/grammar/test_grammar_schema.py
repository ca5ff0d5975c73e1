"""grammar/schema: the one $ref resolver (JSON pointers percent-decoded, then ~1 and ~0
unescaped) that validation and the backends' schema walks use (outlines-core's converter
resolves pointers itself, undecoded: such a $ref is refused for it); the normalisation passes
(same instances, in shapes a backend reads whole) and the oneOf disjointness proof."""

from __future__ import annotations

import re

import pytest

from baton.grammar.guidance.backend import guidance_normal_form
from baton.grammar.outlines.faithful import check_outlines_schema
from baton.grammar.schema.disjoint import branches_disjoint
from baton.grammar.schema.normalise import drop_unknown_formats, integral_counts
from baton.grammar.schema.pattern_regex import may_search
from baton.grammar.schema.refs import (
    PointerNotFound,
    is_local_ref,
    pointer_tokens,
    resolve_pointer,
    resolves,
)
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.validation import validate_spec
from baton.grammar.xgrammar.keywords import xgrammar_unenforced_keywords
from baton.grammar.xgrammar.normal_form import (
    URI_TEMPLATE_PATTERN,
    anchored_search,
    counted_optional_groups,
    xgrammar_normal_form,
)

# A definition named "a/b~c%d e": '/' is ~1, '~' is ~0, then the fragment percent-encodes '%'
# as %25 and the space as %20.
NAME = "a/b~c%d e"
REF = "#/$defs/a~1b~0c%25d%20e"
SCHEMA = {"$defs": {NAME: {"type": "integer", "minimum": 3}}, "$ref": REF}


def test_pointer_tokens_decode_percent_then_tilde() -> None:
    assert pointer_tokens(REF[1:]) == ["$defs", NAME]
    assert pointer_tokens("") == []
    assert pointer_tokens("/") == [""]
    # ~01 is "~1" (not "/"): ~1 is unescaped before ~0.
    assert pointer_tokens("/~01") == ["~1"]
    assert pointer_tokens("/items/0") == ["items", "0"]


def test_resolve_pointer() -> None:
    assert resolve_pointer(SCHEMA, REF[1:]) == {"type": "integer", "minimum": 3}
    assert resolve_pointer(SCHEMA, "") is SCHEMA
    assert resolve_pointer({"anyOf": [True, {"type": "null"}]}, "/anyOf/1") == {"type": "null"}
    assert pointer_tokens("/x%2525y") == ["x%25y"]  # decoded once only
    assert not resolves(SCHEMA, "/$defs/a/b~c%25d%20e")  # unescaped '/' splits the token
    with pytest.raises(PointerNotFound):
        resolve_pointer({"anyOf": [True]}, "/anyOf/1")
    assert is_local_ref("#") and is_local_ref("#/a")
    assert not is_local_ref("other.json#/a") and not is_local_ref("#anchor")


def test_every_walk_follows_an_escaped_pointer() -> None:
    validate_spec(StructuredOutputsParams(json=SCHEMA))  # the reference resolves
    with pytest.raises(ValueError, match="resolves to nothing"):
        validate_spec(StructuredOutputsParams(json={**SCHEMA, "$ref": "#/$defs/a~1b"}))
    # xgrammar's walk reaches the target and sees its keywords; outlines-core does not decode
    # pointers, so it refuses the schema rather than follow another one.
    assert xgrammar_unenforced_keywords(SCHEMA) == set()
    assert xgrammar_unenforced_keywords({**SCHEMA, "$defs": {NAME: {"not": {}}}}) == {"not"}
    checked = check_outlines_schema(SCHEMA)
    assert checked.error is not None and "does not decode" in checked.error
    plain = check_outlines_schema({"$defs": {"n": SCHEMA["$defs"][NAME]}, "$ref": "#/$defs/n"})
    assert plain.error is None and plain.unenforced == ("minimum",)


def test_integral_counts() -> None:
    schema = {
        "maxItems": 2.0,
        "properties": {"a": {"minLength": 1.0}, "maxLength": {"type": "string"}},
        "default": {"maxItems": 2.0},
    }
    assert integral_counts(schema) == {
        "maxItems": 2,
        "properties": {"a": {"minLength": 1}, "maxLength": {"type": "string"}},
        "default": {"maxItems": 2.0},  # data, not a schema
    }
    assert schema["maxItems"] == 2.0  # a copy
    plain = {"maxItems": 2, "default": {"maxItems": 2.0}}
    assert integral_counts(plain) is plain


def test_xgrammar_normal_form_splits_untyped_keywords_by_type() -> None:
    others = ["null", "boolean", "number", "array", "object"]
    # The other types' branch as JSON Schema has it: any item, any property.
    rest = {"type": others, "additionalProperties": {}, "items": {}}
    assert xgrammar_normal_form({"minLength": 2, "title": "t"}) == {
        "title": "t",
        "anyOf": [{"type": "string", "minLength": 2}, rest],
    }
    both = xgrammar_normal_form({"minimum": 1, "maxItems": 3})
    assert both["anyOf"][:2] == [
        {"type": "number", "minimum": 1},
        {"type": "array", "maxItems": 3, "items": {}},  # no items: any item
    ]
    # Keywords xgrammar infers a type from (it built them for that type alone).
    assert xgrammar_normal_form({"properties": {"a": {}}, "required": ["a"]}) == {
        "anyOf": [
            {"type": "object", "properties": {"a": {}}, "required": ["a"]},
            {"type": ["null", "boolean", "number", "string", "array"], "items": {}},
        ]
    }
    assert xgrammar_normal_form({"unevaluatedItems": False})["anyOf"][0] == {
        "type": "array",
        "unevaluatedItems": False,
    }
    # Left alone: typed, a format no one defines, property names (always strings), and a
    # node a $ref points inside.
    for schema in (
        {"type": "string", "minLength": 2},
        {"format": "my-own"},
        {"type": "object", "propertyNames": {"maxLength": 3}},
        {
            "$defs": {"p": {"patternProperties": {"^a": {"type": "integer"}}}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/p/patternProperties/^a"}},
            "additionalProperties": False,
        },
    ):
        assert xgrammar_normal_form(schema) == schema
    # The walk then refuses what the split still cannot say ("minLength" is now enforced).
    assert xgrammar_unenforced_keywords(xgrammar_normal_form({"minLength": 2})) == set()
    assert xgrammar_unenforced_keywords(xgrammar_normal_form({"format": "iri"})) == {"format (iri)"}


def test_xgrammar_normal_form_opens_objects_only_where_that_says_the_same() -> None:
    opened = {"type": "object", "maxProperties": 2, "additionalProperties": {}}
    assert xgrammar_normal_form({"type": "object", "maxProperties": 2}) == opened
    assert xgrammar_normal_form({"type": "array", "prefixItems": [{}]}) == {
        "type": "array",
        "prefixItems": [{}],
        "items": {},
    }
    # Left closed, as strict mode reads them (narrower than the schema, never wider).
    for schema in (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x$": {}}},
        {"type": "object", "propertyNames": {"maxLength": 3}},
        {"type": "object", "properties": {"a": {}}},  # declared properties (compile cost)
        {
            "type": "object",
            "properties": {"a": {}},
            "anyOf": [{"type": "object", "additionalProperties": {}}],
        },
        # Any unevaluatedProperties / unevaluatedItems could see the added keyword.
        {
            "type": "object",
            "properties": {"a": {"type": "object"}},
            "unevaluatedProperties": False,
        },
        {
            "type": "array",
            "prefixItems": [{"type": "array", "prefixItems": [{}]}],
            "unevaluatedItems": False,
        },
    ):
        assert xgrammar_normal_form(schema) == schema, schema
    # A property whose schema is false keeps the object closed: leaving it undeclared (what
    # xgrammar compiles) says the same only there.
    closed = xgrammar_normal_form({"type": "object", "properties": {"a": {}, "b": False}})
    assert closed == {"type": "object", "properties": {"a": {}}}
    # An untyped branch under a typed parent takes the parent's type instead of a split.
    assert xgrammar_normal_form({"type": "object", "anyOf": [{"properties": {"a": {}}}]}) == {
        "type": "object",
        "anyOf": [{"type": "object", "properties": {"a": {}}}],
    }


def test_anchored_search_gives_unanchored_sides_any_text() -> None:
    anything = "[\\s\\S]*"
    assert anchored_search("^https?://") == f"^(?:(?:https?://){anything})$"
    assert anchored_search("a+") == f"^(?:{anything}(?:a+){anything})$"
    assert anchored_search("^a|b$") == f"^(?:(?:a){anything}|{anything}(?:b))$"
    assert anchored_search("[^$]x\\$") == f"^(?:{anything}(?:[^$]x\\$){anything})$"
    # Nothing to do, or left as written: anchored at both ends, a lookaround, an inner anchor,
    # a count past 128 (rebuilt from the pattern as written).
    for pattern in ("^a$", "^a$|^b$", "^(?!x)a", "a(^b)", "x{1,300}"):
        assert anchored_search(pattern) is None, pattern
    # The same strings match, as a search before and in full after.
    for pattern in ("^https?://", "a+|^z$", "[a-z0-9-_]", "^_", "1.0"):
        full = re.compile(anchored_search(pattern) or "")
        for text in ("https://x", "xxaayy", "z", "zz", "!!_!!", "_x", "v1.0.2", "", "A\nB"):
            assert bool(full.fullmatch(text)) == bool(re.search(pattern, text)), (pattern, text)
    # In the normal form: pattern, and patternProperties keys unless a $ref points there.
    assert xgrammar_normal_form({"type": "string", "pattern": "^v"})["pattern"] == (
        f"^(?:(?:v){anything})$"
    )
    keys = xgrammar_normal_form({"type": "object", "patternProperties": {"^v": {}}})
    assert list(keys["patternProperties"]) == [f"^(?:(?:v){anything})$"]


def test_counted_optional_groups_rewrites_group_quantifiers_only() -> None:
    cases = {
        "^(?:xa*)?$": "^(?:xa*){0,1}$",
        "(a)??b": "(a){0,1}b",
        "(?:a(b)?)?": "(?:a(b){0,1}){0,1}",
        # An escaped parenthesis, one in a class, and other quantifiers stay.
        "\\)?": "\\)?",
        "[)?]": "[)?]",
        "[^\\])?]x(b)?": "[^\\])?]x(b){0,1}",
        "a?b*?(c)*?(d){2}?": "a?b*?(c)*?(d){2}?",
    }
    for pattern, written in cases.items():
        assert counted_optional_groups(pattern) == written, pattern
    # Same language, on strings around each pattern.
    for pattern in cases:
        for text in ("", "a", "b", "ab", "xa", "x", ")", "bcd", "bccdd", "]b"):
            expected = re.fullmatch(pattern, text) is not None
            assert (re.fullmatch(counted_optional_groups(pattern), text) is not None) == expected


def test_xgrammar_normal_form_writes_uri_template_as_its_pattern() -> None:
    written = counted_optional_groups(URI_TEMPLATE_PATTERN)
    assert xgrammar_normal_form({"type": "string", "format": "uri-template"}) == {
        "type": "string",
        "pattern": written,
    }
    # The untyped form is split by type, the string branch with the pattern.
    untyped = xgrammar_normal_form({"format": "uri-template"})
    assert untyped["anyOf"][0] == {"type": "string", "pattern": written}
    # A pattern already there: both must hold, so the format stays.
    both = {"type": "string", "format": "uri-template", "pattern": "^a$"}
    assert xgrammar_normal_form(both) == both
    # RFC 6570's examples (levels 1-4) and malformed templates.
    for text in (
        "http://example.com/dictionary/{term:1}/{term}",
        "http://example.com/dictionary",
        "dictionary/{term:1}/{term}",
        "{var}",
        "{+path:6}/here",
        "{#keys*}",
        "X{.list*}",
        "{/var:1,var}",
        "{;x,y,empty}",
        "{?x,y,undef}",
        "?fixed=yes{&x}",
        "{a.b%20c}",
        "caf%C3%A9/ünïcode",
        "",
    ):
        assert re.fullmatch(URI_TEMPLATE_PATTERN[1:-1], text), text
    for text in (
        "http://example.com/dictionary/{term:1}/{term",
        "{}",
        "{var:0}",
        "{var:10000}",
        "{a..b}",
        "a b",
        "100%",
        "{x}}",
        "<tag>",
        'say "hi"',
    ):
        assert not re.fullmatch(URI_TEMPLATE_PATTERN[1:-1], text), text


def test_branches_disjoint() -> None:
    root = {
        "$defs": {
            "cat": {
                "type": "object",
                "properties": {"kind": {"const": "cat"}},
                "required": ["kind"],
            },
            "dog": {
                "type": "object",
                "properties": {"kind": {"enum": ["dog"]}},
                "required": ["kind"],
            },
        }
    }
    cat, dog = {"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}
    assert branches_disjoint([cat, dog], root)
    assert branches_disjoint([{"type": "string"}, {"type": "integer"}, {"const": None}], root)
    assert branches_disjoint([{"const": 1}, {"enum": [2, "1"]}], root)
    assert branches_disjoint([{"type": "integer"}, {"const": 1.5}], root)
    assert not branches_disjoint([{"type": "integer"}, {"type": "number"}], root)
    assert not branches_disjoint([{"const": 1}, {"enum": [1.0]}], root)  # 1 == 1.0
    # Untyped object keywords allow every other type: "x" matches both.
    assert not branches_disjoint([{"properties": {"a": {}}}, {"type": "string"}], root)
    # A discriminator says nothing about instances that are not objects.
    untyped_cat = {"properties": {"kind": {"const": "cat"}}, "required": ["kind"]}
    assert not branches_disjoint([untyped_cat, dog], root)
    assert not branches_disjoint([cat, {"type": "object"}], root)


def test_guidance_normal_form() -> None:
    one_of = {"oneOf": [{"type": "string", "format": "my-own"}, {"type": "integer"}]}
    assert guidance_normal_form(one_of) == {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    kept = {"oneOf": [{"type": "integer"}, {"type": "number", "format": "date"}]}
    assert guidance_normal_form(kept) == kept
    assert drop_unknown_formats({"format": "email"}) == {"format": "email"}


def test_xgrammar_normal_form_merges_all_of() -> None:
    schema = {
        "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "properties": {"b": {"type": "string"}},
        "required": ["b"],
        "allOf": [
            {"$ref": "#/$defs/base"},
            {"required": ["a"], "properties": {"a": {"minimum": 1}}},
        ],
    }
    merged = xgrammar_normal_form(schema)
    assert merged["type"] == "object" and merged["required"] == ["b", "a"]
    # A property both sides define is their conjunction, merged in the next round.
    assert merged["properties"] == {
        "b": {"type": "string"},
        "a": {"type": "integer", "minimum": 1},
    }
    assert "allOf" not in merged and xgrammar_unenforced_keywords(merged) == set()
    # Not merged: a closed side would see the other's properties, items the other's prefix;
    # conflicting types; a $ref into the allOf.
    for unmergeable in (
        {"additionalProperties": False, "allOf": [{"properties": {"x": {}}}, {"required": ["x"]}]},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"allOf": [{"prefixItems": [{"minimum": 3}]}], "items": {"minimum": 5}},
        {"allOf": [{"type": "string"}, {"minLength": 1}], "$defs": {"r": {"$ref": "#/allOf/1"}}},
    ):
        assert "allOf" in xgrammar_normal_form(unmergeable)


def test_xgrammar_normal_form_keeps_a_rewrite_of_a_node_it_partly_leaves() -> None:
    # The tuple items stay (a $ref points inside them); the boolean propertyNames on the same
    # node is still rewritten (a pass once dropped that when it returned early).
    schema = {
        "type": ["object", "array"],
        "propertyNames": False,
        "items": [{"type": "integer"}],
        "properties": {"a": {"$ref": "#/items/0"}},
    }
    out = xgrammar_normal_form(schema)
    assert "propertyNames" not in out and out["maxProperties"] == 0
    assert out["items"] == [{"type": "integer"}]


def test_may_search_is_a_cautious_ecma_search() -> None:
    # One check for both backends' patternProperties walks: a search (anywhere in the
    # name), and a pattern Python cannot read counts as matching.
    assert may_search("^a", "abc") and may_search("b", "abc") and may_search("c$", "abc")
    assert not may_search("^b", "abc") and not may_search("x", "abc")
    assert may_search("(", "abc") and may_search(r"\p{L}", "123")
