"""The xgrammar backend's enforcement table: each enforced and unenforced keyword and format
shown with an instance, and the reasons named for what it does not enforce."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from grammar_testing import VOCAB
from xgrammar_testing import VALIDATORS, accepts

from baton.engine.tokenizer import Tokenizer
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import (
    XGRAMMAR_ENFORCED_FORMATS,
    XGRAMMAR_ENFORCED_KEYWORDS,
    XGRAMMAR_UNENFORCED_FORMATS,
    XGRAMMAR_UNENFORCED_KEYWORDS,
    XGrammarBackend,
    xgrammar_unenforced_keywords,
)
from baton.grammar.xgrammar.normal_form import xgrammar_normal_form


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


# --------------------------------------------------------------------- the enforcement table

# keyword -> (schema, a valid instance, an invalid instance the matcher rejects)
ENFORCED_EVIDENCE: dict[str, tuple[dict, Any, Any]] = {
    "type": ({"type": "integer"}, 1, "a"),
    "enum": ({"enum": [1, "a", None]}, "a", 2),
    "const": ({"const": {"a": 1}}, {"a": 1}, {"a": 2}),
    "properties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"a": 1},
        {"a": "x"},
    ),
    "required": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"a": 1},
        {},
    ),
    "additionalProperties": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "string"},
        },
        {"a": 1, "b": "x"},
        {"a": 1, "b": 2},
    ),
    "unevaluatedProperties": (
        {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "minProperties": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
        {"a": 1},
        {},
    ),
    "maxProperties": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "propertyNames": (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"maxLength": 1},
        },
        {"a": 1},
        {"ab": 1},
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x$": {"type": "integer"}}},
        {"x": 1},
        {"x": "s"},
    ),
    "items": ({"type": "array", "items": {"type": "integer"}}, [1, 2], [1, "a"]),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        [1],
        ["a"],
    ),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
        [1],
        [1, 2],
    ),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1], [1, 2]),
    "minLength": ({"type": "string", "minLength": 2}, "ab", "a"),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "aa", "ab"),
    "format": ({"type": "string", "format": "date"}, "2020-01-31", "2020-13-45"),
    "minimum": ({"type": "number", "minimum": 1.5}, 1.5, 1.4),
    "maximum": ({"type": "integer", "maximum": 3}, 3, 4),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 4, 3),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1.5}, 1.25, 1.5),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 7),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "a", None),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, 1, None),
    "allOf": ({"allOf": [{"type": "string", "maxLength": 1}]}, "s", "ss"),
    "$ref": (
        {
            "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
            "$ref": "#/$defs/n",
        },
        {"next": {"next": {}}},
        {"next": 1},
    ),
}

# format -> (a valid string, an invalid string the matcher rejects)
ENFORCED_FORMAT_EVIDENCE = {
    "date": ("2020-01-31", "2020-13-45"),
    "date-time": ("2020-01-31T10:00:00Z", "2020-01-31"),
    "time": ("10:00:00Z", "25:00"),
    "duration": ("P1D", "1D"),
    "email": ("a@b.com", "ab"),
    "hostname": ("a.b", "-a-"),
    "ipv4": ("1.2.3.4", "1.2.3"),
    "ipv6": ("::1", "xyz"),
    "uri": ("http://a.b/c", "not a uri"),
    "uri-reference": ("a/b", "\\\\"),
    "uri-template": ("/a/{b}", "{"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "xyz"),
    "json-pointer": ("/a", "a"),
    "relative-json-pointer": ("0/a", "/a"),
}
# format -> an invalid string the matcher accepts
UNENFORCED_FORMAT_EVIDENCE = {
    "idn-email": "x",
    "idn-hostname": "-a-",
    "iri": "x",
    "iri-reference": "a b",
    "regex": "(",
}

# label reported by xgrammar_unenforced_keywords -> (schema, an invalid instance the matcher
# accepts, the JSON-Schema draft that says it is invalid)
UNENFORCED_EVIDENCE: dict[str, tuple[Any, Any, str]] = {
    "not": ({"type": "integer", "not": {"const": 3}}, 3, "2020-12"),
    "if": ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, 11, "2020-12"),
    "dependentRequired": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
        "2020-12",
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "properties": {"a": {}, "b": {}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        {"a": 1},
        "2020-12",
    ),
    "dependencies": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
        {"a": 1},
        "7",
    ),
    "uniqueItems": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 1],
        "2020-12",
    ),
    "contains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}},
        [1],
        "2020-12",
    ),
    "$dynamicRef": (
        {"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$dynamicRef": "#n"}}},
        {"c": 1},
        "2020-12",
    ),
    "$recursiveRef": (
        {
            "$recursiveAnchor": True,
            "type": "object",
            "properties": {"c": {"$recursiveRef": "#"}},
        },
        {"c": 1},
        "2019-09",
    ),
    "allOf (several subschemas)": (
        {"allOf": [{"type": "integer"}, {"minimum": 3}]},
        "a",
        "2020-12",
    ),
    "minimum (beside $ref)": (
        {"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "minimum": 3},
        2,
        "2020-12",
    ),
    "maxLength (beside anyOf)": (
        {"type": "string", "maxLength": 1, "anyOf": [{"type": "string"}, {"type": "integer"}]},
        "ss",
        "2020-12",
    ),
    "required (beside oneOf)": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "oneOf": [{"type": "object"}, {"type": "string"}],
        },
        {},
        "2020-12",
    ),
    "type (beside allOf)": ({"type": "integer", "allOf": [{"type": "string"}]}, "a", "2020-12"),
    "type (beside enum)": ({"type": "integer", "enum": [1, "x"]}, "x", "2020-12"),
    "enum (beside const)": ({"enum": [1], "const": "a"}, "a", "2020-12"),
    "minimum (no type)": ({"minimum": 3}, 2, "2020-12"),
    "required (no type)": ({"required": ["a"]}, {}, "2020-12"),
    "patternProperties (no type)": (
        {"patternProperties": {"^x": {"type": "integer"}}},
        {"x": "s"},
        "2020-12",
    ),
    "patternProperties (several patterns)": (
        {
            "type": "object",
            "patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}},
        },
        {"aaaa": 31},
        "2020-12",
    ),
    "patternProperties (matches a declared property)": (
        {
            "type": "object",
            "properties": {"foo": {"type": "string"}},
            "patternProperties": {"f.*": {"maxLength": 2}},
            "additionalProperties": False,
        },
        {"foo": "abcd"},
        "2020-12",
    ),
    "multipleOf (number)": ({"type": "number", "multipleOf": 0.5}, 1.3, "2020-12"),
    "minLength (beside pattern/format)": (
        {"type": "string", "pattern": "^a+$", "minLength": 3},
        "a",
        "2020-12",
    ),
    "pattern (beside format)": (
        {"type": "string", "format": "date", "pattern": "^2"},
        "1999-01-01",
        "2020-12",
    ),
    "pattern (lookaround)": ({"type": "string", "pattern": "^(?!a).*$"}, "a", "2020-12"),
    "patternProperties (lookaround)": (
        {
            "type": "object",
            "patternProperties": {"^(?!@@)[@a-z]+$": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"@@a": 1},
        "2020-12",
    ),
    "patternProperties (beside additionalProperties)": (
        {
            "type": "object",
            "properties": {"a": {}},
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": {"type": "string"},
        },
        {"a": 1, "x": "s"},
        "2020-12",
    ),
    "required (undeclared property)": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["b"],
            "additionalProperties": {"type": "integer"},
        },
        {"a": 1},
        "2020-12",
    ),
    "propertyNames (declared properties)": (
        {"type": "object", "properties": {"aa": {}}, "propertyNames": {"maxLength": 1}},
        {"aa": 1},
        "2020-12",
    ),
    "$ref (non-local)": (
        {
            "$id": "http://example.com/root.json",
            "$defs": {"a": {"$id": "a.json", "type": "integer"}},
            "$ref": "a.json",
        },
        "a",
        "2020-12",
    ),
}


@pytest.mark.parametrize("keyword", sorted(ENFORCED_EVIDENCE))
def test_enforced_keyword(backend: XGrammarBackend, tokenizer: Tokenizer, keyword: str) -> None:
    schema, valid, invalid = ENFORCED_EVIDENCE[keyword]
    assert keyword in json.dumps(schema)
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    assert checker.is_valid(valid) and not checker.is_valid(invalid)
    assert accepts(backend, tokenizer, schema, valid)
    assert not accepts(backend, tokenizer, schema, invalid)
    assert xgrammar_unenforced_keywords(schema) == set()


@pytest.mark.parametrize("fmt", sorted(ENFORCED_FORMAT_EVIDENCE))
def test_enforced_format(backend: XGrammarBackend, tokenizer: Tokenizer, fmt: str) -> None:
    schema = {"type": "string", "format": fmt}
    valid, invalid = ENFORCED_FORMAT_EVIDENCE[fmt]
    assert accepts(backend, tokenizer, schema, valid)
    assert not accepts(backend, tokenizer, schema, invalid)
    assert xgrammar_unenforced_keywords(schema) == set()


def test_uri_reference_takes_absolute_and_relative_references(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    # xgrammar's own uri-reference grammar rejected every absolute URI; the normal form
    # writes RFC 3986's URI-reference as a pattern instead.
    schema = {"type": "string", "format": "uri-reference"}
    for text in (
        "https://example.com/probs/out-of-credit",
        "http://x.com:8080/p?q=1#f",
        "ldap://[2001:db8::7]/c=GB?objectClass?one",
        "urn:isbn:0451450523",
        "mailto:John.Doe@example.com",
        "file:///etc/hosts",
        "//foo.bar/?baz=qux#quux",
        "/abc",
        "../a/b:c",
        "?q=1",
        "#fragment",
        "",
    ):
        assert accepts(backend, tokenizer, schema, text), text
    for text in ("\\\\WINDOWS\\share", "#frag#ment", "http:// a", "1a:b", "100%", "a{b}"):
        assert not accepts(backend, tokenizer, schema, text), text


@pytest.mark.parametrize("fmt", sorted(UNENFORCED_FORMAT_EVIDENCE))
def test_unenforced_format(backend: XGrammarBackend, tokenizer: Tokenizer, fmt: str) -> None:
    schema = {"type": "string", "format": fmt}
    assert accepts(backend, tokenizer, schema, UNENFORCED_FORMAT_EVIDENCE[fmt])
    assert xgrammar_unenforced_keywords(schema) == {f"format ({fmt})"}


@pytest.mark.parametrize("label", sorted(UNENFORCED_EVIDENCE))
def test_unenforced_keyword(backend: XGrammarBackend, tokenizer: Tokenizer, label: str) -> None:
    schema, invalid, draft = UNENFORCED_EVIDENCE[label]
    assert not VALIDATORS[draft](schema).is_valid(invalid)  # truly invalid...
    assert label in xgrammar_unenforced_keywords(schema)
    if label.endswith("(no type)") or label == "allOf (several subschemas)":
        # ...and xgrammar would take it, but baton first splits such a schema by type or
        # merges its allOf (xgrammar_normal_form), which xgrammar then reads whole or the walk
        # reports as such (required of undeclared properties is).
        after = xgrammar_unenforced_keywords(xgrammar_normal_form(schema))
        assert label not in after
        assert after == ({"required (undeclared property)"} if "required" in label else set())
        if not after:
            assert not accepts(backend, tokenizer, schema, invalid)
            if "allOf" not in label:
                assert accepts(backend, tokenizer, schema, [None, "s", 1.5, {}])
        return
    assert accepts(backend, tokenizer, schema, invalid)  # ...yet xgrammar takes it


def test_the_tables_are_all_evidenced() -> None:
    assert set(XGRAMMAR_ENFORCED_KEYWORDS) == set(ENFORCED_EVIDENCE)
    assert set(XGRAMMAR_UNENFORCED_KEYWORDS) <= set(UNENFORCED_EVIDENCE)
    assert set(XGRAMMAR_ENFORCED_FORMATS) == set(ENFORCED_FORMAT_EVIDENCE)
    assert set(XGRAMMAR_UNENFORCED_FORMATS) == set(UNENFORCED_FORMAT_EVIDENCE)
    assert not set(XGRAMMAR_ENFORCED_KEYWORDS) & set(XGRAMMAR_UNENFORCED_KEYWORDS)


def test_oneof_is_enforced_as_anyof(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    # xgrammar builds oneOf as anyOf: a value matching two branches is accepted, so
    # overlapping branches are reported; provably disjoint ones (types, consts) are not.
    schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    assert not jsonschema.Draft202012Validator(schema).is_valid(1)
    assert accepts(backend, tokenizer, schema, 1)
    assert xgrammar_unenforced_keywords(schema) == {"oneOf (overlapping branches)"}
    disjoint = {"oneOf": [{"type": "string"}, {"type": "integer"}, {"const": None}]}
    assert xgrammar_unenforced_keywords(disjoint) == set()
    consts = {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]}
    assert xgrammar_unenforced_keywords(consts) == set()
    # xgrammar writes the untyped first branch as objects only, but "x" matches it too (and
    # the second): the branches overlap under JSON Schema, so xgrammar would accept "x".
    untyped = {"oneOf": [{"properties": {"a": {"type": "integer"}}}, {"type": "string"}]}
    assert not jsonschema.Draft202012Validator(untyped).is_valid("x")
    assert accepts(backend, tokenizer, untyped, "x")
    assert xgrammar_unenforced_keywords(untyped) == {"oneOf (overlapping branches)"}


def test_no_false_alarms_on_a_typical_schema() -> None:
    schema = {
        "$defs": {"Kind": {"enum": ["a", "b"], "type": "string", "title": "Kind"}},
        "type": "object",
        "title": "Model",
        "properties": {
            "name": {"type": "string", "maxLength": 10, "description": "x"},
            "when": {"type": "string", "format": "date-time"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "kind": {"anyOf": [{"$ref": "#/$defs/Kind"}, {"type": "null"}], "default": None},
            "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            "count": {"type": "integer", "multipleOf": 2},
            "ext": {"type": "object", "additionalProperties": {"type": "integer"}},
            "x-vendor": {"x-unknown-keyword": True, "type": "boolean"},
        },
        "required": ["name", "tags"],
        "oneOf": [{"required": ["when"]}, {"required": ["kind"]}],
    }
    found = xgrammar_unenforced_keywords(schema)
    # Only the root's siblings of oneOf are reported; nothing inside the properties.
    assert found == {
        "type (beside oneOf)",
        "properties (beside oneOf)",
        "required (beside oneOf)",
        "required (no type)",
        "oneOf (overlapping branches)",
    }
    del schema["oneOf"]
    assert xgrammar_unenforced_keywords(schema) == set()
    # Unreferenced definitions do not count; referenced ones do.
    schema["$defs"]["Unused"] = {"not": {}}
    assert xgrammar_unenforced_keywords(schema) == set()
    schema["properties"]["kind"] = {"$ref": "#/$defs/Unused"}
    assert xgrammar_unenforced_keywords(schema) == {"not"}
    assert xgrammar_unenforced_keywords(True) == set()


def test_unsupported_reason(backend: XGrammarBackend) -> None:
    spec = StructuredOutputsParams
    assert backend.unsupported_reason(spec(regex="a+")) is None
    assert backend.unsupported_reason(spec(json_object=True)) is None
    assert backend.unsupported_reason(spec(json={"type": "integer", "minimum": 0})) is None
    schema = {"type": "array", "items": {"not": {"type": "null"}}, "uniqueItems": True}
    reason = backend.unsupported_reason(spec(json=schema))
    assert reason is not None and "not" in reason and "uniqueItems" in reason
    assert backend.unsupported_reason(spec(json=schema, allow_unenforced=True)) is None
    assert backend.unsupported_reason(spec(json="{broken")) is None  # compile() reports it
