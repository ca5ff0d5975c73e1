"""The outlines-core backend: the schemas it takes (instances written and rejected) and the
shapes it refuses, which fall through to guidance."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema.validators import validator_for
from outlines_testing import _accepts, _compact, _ids

from baton.engine.tokenizer import Tokenizer
from baton.grammar.outlines.backend import OutlinesBackend
from baton.grammar.outlines.faithful import check_outlines_schema
from baton.grammar.spec import AUTO_ORDER, StructuredOutputsParams


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> OutlinesBackend:
    return OutlinesBackend(tokenizer, tokenizer.vocab_size)


# -- schemas outlines takes ---------------------------------------------------------------------


# (name, schema, valid instances outlines writes, invalid instances it rejects); every instance
# is checked against the schema with jsonschema first.
TAKEN: list[tuple[str, dict[str, Any], list[Any], list[Any]]] = [
    (
        "recursion through an optional property",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "next": {"$ref": "#/$defs/node"},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        [{"v": 1}, {"v": 1, "next": {"v": 2, "next": {"v": 3}}}],
        [{"next": {"v": 2}}, {"v": 1, "next": {}}],
    ),
    (
        "a pattern is matched at JSON-string level",
        {"type": "string", "pattern": "^a-\\d$"},
        ["a-1"],
        ["a1", "a-x", "xa-1"],
    ),
    (
        "an unanchored pattern is a search",
        {"type": "string", "pattern": "x[0-9]"},
        ["x1", "abx1", "x1yz"],
        ["x", "ab"],
    ),
    (
        "a negated class never breaks the string",
        {"type": "string", "pattern": "^[^,]+$"},
        ["ab", "é"],
        ["a,b", ""],
    ),
    (
        "anchored alternatives",
        {"type": "string", "pattern": "^in$|^out$"},
        ["in", "out"],
        ["inout", "i"],
    ),
    (
        "a length bound counts characters",
        {"type": "string", "minLength": 1, "maxLength": 2.0},
        ["é", "éé", "ab"],
        ["", "ééé"],
    ),
    (
        "uuid format",
        {"type": "string", "format": "uuid"},
        ["12345678-1234-1234-1234-123456789abc"],
        ["12345678-1234-1234-1234-123456789ab", "x"],
    ),
    (
        "property names that need JSON escaping",
        {"type": "object", "properties": {'a"b': {"type": "integer"}}, "required": ['a"b']},
        [{'a"b': 1}],
        [{"ab": 1}, {}],
    ),
    (
        "draft 4 tuple items",
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "array",
            "items": [{"type": "integer"}, {"type": "string"}],
        },
        [[1, "a"]],
        [["a", 1]],
    ),
    (
        "legacy draft ignores $ref siblings",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"i": {"type": "integer"}},
            "properties": {"a": {"$ref": "#/definitions/i", "minimum": 5}},
        },
        [{"a": 1}],
        [{"a": "x"}],
    ),
    (
        "keywords of one type only write that type",
        {"items": {"type": "integer"}, "maxItems": 2},
        [[1], [1, 2]],
        [["a"], [1, 2, 3]],
    ),
    (
        "allOf with one member beside any-values",
        {"allOf": [True, {}, {"type": "integer"}]},
        [3],
        ["3"],
    ),
    (
        "an object closed by additionalProperties false",
        {"type": "object", "additionalProperties": False},
        [{}],
        [{"a": 1}],
    ),
]


@pytest.mark.parametrize("name, schema, valid, invalid", TAKEN, ids=[r[0] for r in TAKEN])
def test_taken_schemas(
    backend: OutlinesBackend,
    tokenizer: Tokenizer,
    name: str,
    schema: dict[str, Any],
    valid: list[Any],
    invalid: list[Any],
) -> None:
    validator_cls = validator_for(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    spec = StructuredOutputsParams(json=schema)
    assert backend.unsupported_reason(spec) is None
    for instance in valid:
        assert validator.is_valid(instance), instance
        assert _accepts(backend, tokenizer, spec, _compact(instance)), instance
    for instance in invalid:
        assert not validator.is_valid(instance), instance
        assert not _accepts(backend, tokenizer, spec, _compact(instance)), instance


def test_false_branches_and_properties_are_left_out() -> None:
    checked = check_outlines_schema(
        {"anyOf": [{"type": "integer"}, False], "properties": {"a": False}}, open_objects=True
    )
    assert checked.error is None and checked.unenforced == ("anyOf",)
    assert checked.schema == {"anyOf": [{"type": "integer"}], "properties": {}}


def test_nested_any_value_stays_one_alternative() -> None:
    """outlines writes the any-value regex as a bare alternation; nested, it must be wrapped
    or "[{}]" would also match '["foo","bar",37]'. Checked on the regex (Python's re reads
    it), since an index over the any-value regex takes seconds to build."""
    import re

    from outlines_core.json_schema import build_regex_from_schema

    for schema in ({"prefixItems": [{}], "items": False}, {"properties": {"a": True}}):
        checked = check_outlines_schema(schema)
        assert checked.error is None and not checked.unenforced
        regex = re.compile(build_regex_from_schema(json.dumps(checked.schema), ""))
        if "prefixItems" in schema:
            assert regex.fullmatch('[{"a":[1]}]') and regex.fullmatch("[null]")
            assert not regex.fullmatch('["foo","bar",37]') and not regex.fullmatch("null")
        else:
            assert regex.fullmatch('{"a":[1]}') and regex.fullmatch('{"a":null}')
            assert not regex.fullmatch('{"a":1,"b"}') and not regex.fullmatch('{"a":1:2}')


def test_disable_additional_properties(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "additionalProperties": {"type": "integer"}}
    closed = StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True)
    assert _accepts(backend, tokenizer, closed, "{}")
    assert not _accepts(backend, tokenizer, closed, '{"a":1}')
    # The default closes only objects that declare names: this one is any object.
    assert _accepts(backend, tokenizer, StructuredOutputsParams(json={"type": "object"}), '{"a":1}')
    assert _accepts(backend, tokenizer, StructuredOutputsParams(json=schema), '{"a":1}')
    assert not _accepts(backend, tokenizer, StructuredOutputsParams(json=schema), '{"a":"x"}')


# -- schemas outlines refuses --------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "allOf with several subschemas"),
        ({"$ref": "#/$defs/missing"}, "cannot follow"),
        ({"$ref": "https://example.com/s.json"}, "only local $ref"),
        ({"$defs": {"a~b": {"type": "integer"}}, "$ref": "#/$defs/a~0b"}, "does not decode"),
        ({"enum": [{"a.b": 1}]}, "would not escape"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "false subschema"),
        ({"type": "string", "properties": {"a": {}}}, "properties beside a type"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems above maxItems"),
        (
            {
                "$defs": {"l": {"type": "array", "items": {"$ref": "#/$defs/l"}}},
                "$ref": "#/$defs/l",
            },
            "$ref nested more than 4 deep",
        ),
    ],
)
def test_shapes_outlines_cannot_write(
    backend: OutlinesBackend, schema: dict[str, Any], words: str
) -> None:
    for allow in (False, True):
        spec = StructuredOutputsParams(json=schema, allow_unenforced=allow)
        reason = backend.unsupported_reason(spec)
        assert reason is not None and "cannot take" in reason and words in reason, reason
    assert check_outlines_schema(schema).error is not None


def test_refused_schemas_fall_through_to_guidance(
    backend: OutlinesBackend, tokenizer: Tokenizer
) -> None:
    """A schema xgrammar and outlines would each enforce only partly goes to llguidance under
    auto, which enforces it (outputs checked with jsonschema)."""
    from baton.grammar.guidance.backend import GuidanceBackend
    from baton.grammar.xgrammar.backend import XGrammarBackend

    schema = {
        "$defs": {"reffed": {"type": "array", "items": {"type": "integer"}}},
        "type": "object",
        "properties": {"foo": {"$ref": "#/$defs/reffed", "maxItems": 2}},
        "required": ["foo"],
    }
    spec = StructuredOutputsParams(json=schema)
    guidance = GuidanceBackend(tokenizer, tokenizer.vocab_size)
    backends = {
        "xgrammar": XGrammarBackend(tokenizer, tokenizer.vocab_size),
        "outlines": backend,
        "guidance": guidance,
    }
    reasons = {name: backends[name].unsupported_reason(spec) for name in AUTO_ORDER}
    assert "maxItems" in (reasons["outlines"] or "")
    assert [name for name in AUTO_ORDER if reasons[name] is None][0] == "guidance"
    validator = validator_for(schema)(schema)
    matcher = guidance.compile(spec).new_matcher()
    for text, valid in (('{"foo":[1,2]}', True), ('{"foo":[1,2,3]}', False)):
        assert validator.is_valid(json.loads(text)) == valid
        matcher.reset()
        ok = matcher.accept_tokens([*_ids(tokenizer, text), tokenizer.eos_token_ids[0]])
        assert (ok and matcher.is_terminated()) == valid, text
