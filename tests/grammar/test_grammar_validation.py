"""Submission-time validation of structured-output specs."""

from __future__ import annotations

import dataclasses
import json
import pickle
import warnings

import pytest

from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.validation import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_SPEC_BYTES,
    check_enforceable,
    validate_spec,
)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutputsParams(json='{"type": '), ["not valid JSON"]),
        (StructuredOutputsParams(json={"type": 5}), ["schema is invalid", "type"]),
        (
            StructuredOutputsParams(json={"properties": {"a": {"minLength": -1}}}),
            ["properties/a/minLength", "minimum of 0"],
        ),
        (StructuredOutputsParams(json="[1, 2]"), ["object or boolean", "list"]),
        (StructuredOutputsParams(json=False), ["false"]),
        (StructuredOutputsParams(json={"$ref": "#/nope"}), ["$ref", "'#/nope'", "nothing"]),
        (
            StructuredOutputsParams(
                json={
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/b"}},
                    "$defs": {"c": {"type": "integer"}},
                }
            ),
            ["'#/$defs/b'", "at /properties/a"],
        ),
        (StructuredOutputsParams(regex="("), ["regex", "parenthesis"]),
        (StructuredOutputsParams(regex="a{3,2}"), ["regex"]),
        (StructuredOutputsParams(regex=r"\p{L}+", backend="xgrammar"), ["regex", "xgrammar"]),
        (StructuredOutputsParams(regex="(?=a)a", backend="outlines"), ["regex", "outlines"]),
        (StructuredOutputsParams(grammar='root ::= "a'), ["EBNF", "line 1"]),
        (StructuredOutputsParams(grammar='start ::= "a"', backend="xgrammar"), ["EBNF", "root"]),
        (StructuredOutputsParams(grammar='start: "a"', backend="xgrammar"), ["EBNF", "xgrammar"]),
        (StructuredOutputsParams(grammar="start: foo"), ["xgrammar", "guidance", "unknown name"]),
        (StructuredOutputsParams(choice=["a", ""]), ["choice 1", "empty"]),
        (StructuredOutputsParams(structural_tag="{"), ["structural_tag", "JSON"]),
        (StructuredOutputsParams(structural_tag="[1]"), ["structural_tag", "object"]),
        (StructuredOutputsParams(structural_tag={"type": 1}), ["structural_tag", "invalid"]),
        (
            StructuredOutputsParams(
                structural_tag={
                    "type": "structural_tag",
                    "format": {"type": "json_schema", "json_schema": {"type": "wrong"}},
                }
            ),
            ["structural_tag JSON schema 0", "invalid at type"],
        ),
        (
            StructuredOutputsParams(
                structural_tag={"structures": [{"begin": "<a>", "schema": {"minimum": "x"}}]}
            ),
            ["structures[0]", "begin and end"],
        ),
    ],
    ids=lambda v: v.kind if isinstance(v, StructuredOutputsParams) else None,
)
def test_bad_specs_name_the_problem(spec: StructuredOutputsParams, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        validate_spec(spec)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_size_limits() -> None:
    big = {"type": "string", "description": "x" * DEFAULT_MAX_SPEC_BYTES}
    for spec in (
        StructuredOutputsParams(json=big),
        StructuredOutputsParams(json=json.dumps(big)),
        StructuredOutputsParams(regex="a" * (DEFAULT_MAX_SPEC_BYTES + 1)),
        StructuredOutputsParams(grammar='root ::= "' + "a" * DEFAULT_MAX_SPEC_BYTES + '"'),
        StructuredOutputsParams(choice=["a" * DEFAULT_MAX_SPEC_BYTES]),
    ):
        with pytest.raises(ValueError, match=f"over the limit of {DEFAULT_MAX_SPEC_BYTES} bytes"):
            validate_spec(spec)
    small = StructuredOutputsParams(json={"type": "string", "description": "x" * 200})
    validate_spec(small)
    with pytest.raises(ValueError, match="over the limit of 100 bytes"):
        validate_spec(small, max_spec_bytes=100)


def test_depth_limits() -> None:
    validate_spec(StructuredOutputsParams(json=_nested(DEFAULT_MAX_DEPTH // 2)))
    validate_spec(StructuredOutputsParams(json=_nested(DEFAULT_MAX_DEPTH)))
    deep = StructuredOutputsParams(json=_nested(DEFAULT_MAX_DEPTH + 1))
    with pytest.raises(ValueError, match=f"over the limit of {DEFAULT_MAX_DEPTH}"):
        validate_spec(deep)
    with pytest.raises(ValueError, match="over the limit of 8"):
        validate_spec(StructuredOutputsParams(json=_nested(9)), max_depth=8)
    # Too deep for the JSON parser itself: still a ValueError naming the limit.
    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="deeper than the limit"):
        validate_spec(StructuredOutputsParams(json=text), max_spec_bytes=10**6)


class _Model:
    """Stands in for a pydantic model class."""

    @staticmethod
    def model_json_schema() -> dict:
        return {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}),
        StructuredOutputsParams(json='{"type": "array", "items": {"type": "integer"}}'),
        StructuredOutputsParams(json=True),
        StructuredOutputsParams(json=_Model),
        StructuredOutputsParams(json={"$schema": "http://json-schema.org/draft-07/schema#"}),
        StructuredOutputsParams(
            json={
                "$defs": {"a/b c": {"type": "integer"}, "t": {"prefixItems": [{"type": "null"}]}},
                "properties": {
                    "x": {"$ref": "#/$defs/a~1b%20c"},
                    "y": {"$ref": "#/$defs/t/prefixItems/0"},
                    "z": {"$ref": "#"},
                    "$ref": {"type": "string"},  # a property named "$ref"
                    "e": {"enum": [{"$ref": "#/not/a/reference"}]},
                    "n": {"$id": "https://example.com/n", "$ref": "#/other/base"},
                },
            }
        ),
        StructuredOutputsParams(json={"$schema": "https://example.com/unknown-metaschema"}),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[0-9]{3}-\d+"),
        StructuredOutputsParams(regex=r"\p{L}+"),  # outlines reads it, xgrammar does not
        StructuredOutputsParams(regex="(?i)abc", backend="outlines"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='root ::= "a" | "b"'),
        StructuredOutputsParams(
            structural_tag={
                "type": "structural_tag",
                "format": {"type": "const_string", "value": "hi"},
            }
        ),
    ],
    ids=lambda s: s.kind,
)
def test_good_specs_pass(spec: StructuredOutputsParams) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_spec(spec)


def test_check_enforceable() -> None:
    auto = StructuredOutputsParams(json={"type": "integer", "minimum": 3})
    check_enforceable(auto, {"xgrammar": None, "outlines": "would not enforce: minimum"})
    check_enforceable(auto, {"xgrammar": "broken", "outlines": None})
    with pytest.raises(ValueError) as info:
        check_enforceable(auto, {"xgrammar": "reason one", "outlines": "reason two"})
    message = str(info.value)
    assert "xgrammar: reason one" in message and "outlines: reason two" in message
    only_outlines = StructuredOutputsParams(json={"type": "integer"}, backend="outlines")
    with pytest.raises(ValueError, match="outlines: nope") as info:
        check_enforceable(only_outlines, {"xgrammar": None, "outlines": "nope"})
    assert "xgrammar" not in str(info.value)
    with pytest.raises(ValueError, match="outlines: backend not available"):
        check_enforceable(only_outlines, {"xgrammar": None})


def test_spec_text_is_computed_once_and_never_carried_to_a_new_spec() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = StructuredOutputsParams(json=schema)
    assert spec.spec_text == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    assert spec.spec_text is spec.spec_text  # cached: admission asks about five times
    other = dataclasses.replace(spec, json={"type": "string"})
    assert other.spec_text == '{"type":"string"}'
    assert spec == StructuredOutputsParams(json=schema)  # the cache is not a field
    assert pickle.loads(pickle.dumps(spec)).spec_text == spec.spec_text
    # The spec owns a copy: changing the caller's dict changes neither the schema nor its key.
    schema["properties"]["a"]["type"] = "string"
    assert spec.schema == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert spec.spec_text == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    # A dict that cannot be serialised is kept as given and refused at submission, as before.
    odd = {"type": "object", "default": {1, 2}}
    assert StructuredOutputsParams(json=odd).json is odd
