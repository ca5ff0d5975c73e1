"""The outlines-core backend: kinds, matcher semantics, the schemas it takes and refuses, the
enforcement table, shared schemas."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema.validators import validator_for

from baton.bench.grammars.mask_families import in_schema_order
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import GrammarError, allocate_bitmask, bitmask_width
from baton.grammar.outlines.backend import (
    OUTLINES_CONDITIONAL_KEYWORDS,
    OUTLINES_ENFORCED_KEYWORDS,
    OUTLINES_UNENFORCED_KEYWORDS,
    OutlinesBackend,
    OutlinesCompiledGrammar,
    OutlinesMatcher,
    choice_regex,
    estimate_dfa_states,
)
from baton.grammar.outlines.faithful import check_outlines_schema
from baton.grammar.spec import AUTO_ORDER, StructuredOutputsParams

OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> OutlinesBackend:
    return OutlinesBackend(tokenizer, tokenizer.vocab_size)


_COMPILED: dict[tuple[Any, ...], OutlinesCompiledGrammar] = {}


def _compile(backend: OutlinesBackend, spec: StructuredOutputsParams) -> OutlinesCompiledGrammar:
    key = (
        id(backend),
        spec.kind,
        json.dumps(spec.schema) if spec.kind == "json" else spec.spec_text,
    )
    key += (spec.options_key, spec.allow_unenforced)
    if key not in _COMPILED:
        _COMPILED[key] = backend.compile(spec)
    return _COMPILED[key]


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _accepts(
    backend: OutlinesBackend, tokenizer: Tokenizer, spec: StructuredOutputsParams, text: str
) -> bool:
    """Whether the whole text followed by EOS is accepted (and terminates the matcher)."""
    matcher = _compile(backend, spec).new_matcher()
    ok = matcher.accept_tokens([*_ids(tokenizer, text), tokenizer.eos_token_ids[0]])
    return ok and matcher.is_terminated()


def _allowed(matcher: OutlinesMatcher, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].numpy().view("uint32")
    return {i for i in range(vocab_size) if (int(words[i >> 5]) >> (i & 31)) & 1}


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- kinds ---------------------------------------------------------------------------------------


def test_regex_kind(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+")
    assert backend.unsupported_reason(spec) is None
    assert _accepts(backend, tokenizer, spec, "123-abc")
    assert not _accepts(backend, tokenizer, spec, "12-abc")
    assert not _accepts(backend, tokenizer, spec, "123-abc!")
    anchored = StructuredOutputsParams(regex=r"^[0-9]{3}$")
    assert _accepts(backend, tokenizer, anchored, "123")
    assert not _accepts(backend, tokenizer, anchored, "1234")


def test_choice_kind_escapes_metacharacters(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(choice=["a.b", "(x)", "yes no", "naïve"])
    for choice in spec.choice or ():
        assert _accepts(backend, tokenizer, spec, choice)
    for wrong in ("axb", "x", "(x", "yes", ""):
        assert not _accepts(backend, tokenizer, spec, wrong)
    assert choice_regex(["a|b"]) != "(?:a|b)"


def test_json_kind(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(json=OBJECT_SCHEMA)
    assert backend.unsupported_reason(spec) is None
    assert _accepts(backend, tokenizer, spec, '{"name":"Bob","age":3}')
    assert not _accepts(backend, tokenizer, spec, '{"name":"Bob"}')
    assert not _accepts(backend, tokenizer, spec, '{"name":"Bob","age":"3"}')
    assert not _accepts(backend, tokenizer, spec, '{"name": "Bob","age":3}')  # compact


def test_json_kind_keeps_schema_property_order(
    backend: OutlinesBackend, tokenizer: Tokenizer
) -> None:
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}}}
    spec = StructuredOutputsParams(json=json.dumps(schema), backend="outlines")
    assert _accepts(backend, tokenizer, spec, '{"z":1,"a":2}')
    assert not _accepts(backend, tokenizer, spec, '{"a":2,"z":1}')


def test_json_whitespace_any_is_bounded(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(json=OBJECT_SCHEMA, whitespace="any", max_whitespace_cnt=2)
    assert _accepts(backend, tokenizer, spec, '{ "name": "Bob",\n "age": 3}')
    assert _accepts(backend, tokenizer, spec, '{"name":"Bob","age":3}')
    assert not _accepts(backend, tokenizer, spec, '{   "name":"Bob","age":3}')


@pytest.mark.slow
def test_json_object_kind_is_depth_bounded(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(json_object=True)
    assert backend.unsupported_reason(spec) is None
    assert _accepts(backend, tokenizer, spec, '{"a":[1,{"b":null}],"c":"d"}')
    assert _accepts(backend, tokenizer, spec, "{}")
    assert not _accepts(backend, tokenizer, spec, "[1]")
    assert not _accepts(backend, tokenizer, spec, '{"a":1,}')
    assert not _accepts(backend, tokenizer, spec, '{"a":{"b":{"c":{"d":1}}}}')  # too deep


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(grammar='root ::= "a"'),
        StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {}}),
    ],
)
def test_unsupported_kinds(backend: OutlinesBackend, spec: StructuredOutputsParams) -> None:
    reason = backend.unsupported_reason(spec)
    assert reason is not None and spec.kind in reason
    with pytest.raises(GrammarError, match=spec.kind):
        backend.compile(spec)


def test_huge_dfa_is_refused(backend: OutlinesBackend) -> None:
    for spec in (
        StructuredOutputsParams(json={"type": "string", "maxLength": 1000}),
        StructuredOutputsParams(regex="a{100000}"),
    ):
        reason = backend.unsupported_reason(spec)
        assert reason is not None and "DFA" in reason
        with pytest.raises(GrammarError, match="DFA"):
            backend.compile(spec)
    assert estimate_dfa_states('"[^"]{0,1000}"') > 4000
    assert estimate_dfa_states("[0-9]{3}") == 3


def test_bad_regex_is_a_grammar_error(backend: OutlinesBackend) -> None:
    with pytest.raises(GrammarError, match="cannot compile"):
        backend.compile(StructuredOutputsParams(regex="(", backend="outlines"))


# -- matcher -------------------------------------------------------------------------------------


def test_eos_only_at_accepting_states(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    matcher = _compile(backend, StructuredOutputsParams(regex="[0-9]{1,3}")).new_matcher()
    assert eos not in _allowed(matcher, tokenizer.vocab_size)
    assert matcher.validate_tokens([eos]) == 0
    assert not matcher.accept_tokens([eos])
    assert not matcher.is_terminated()
    assert matcher.accept_tokens(_ids(tokenizer, "12"))
    allowed = _allowed(matcher, tokenizer.vocab_size)
    assert eos in allowed
    assert matcher.validate_tokens([eos, *_ids(tokenizer, "3")]) == 1
    assert matcher.accept_tokens([eos])
    assert matcher.is_terminated()
    assert not matcher.accept_tokens(_ids(tokenizer, "3"))
    assert matcher.validate_tokens([eos]) == 0
    assert _allowed(matcher, tokenizer.vocab_size) == set(tokenizer.eos_token_ids)


def test_special_tokens_never_allowed(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(json=OBJECT_SCHEMA)
    matcher = _compile(backend, spec).new_matcher()
    specials = set(tokenizer.all_special_ids) - set(tokenizer.eos_token_ids)
    for text in ("", '{"name":"', '{"name":"Bob","age":3'):
        matcher.reset()
        assert matcher.accept_tokens(_ids(tokenizer, text))
        assert not specials & _allowed(matcher, tokenizer.vocab_size)
        assert all(matcher.validate_tokens([s]) == 0 for s in specials)


def test_mask_equals_validate_tokens(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    """Every bit of the mask, over the whole vocabulary, at states inside keys, strings,
    numbers and at the accepting end."""
    spec = StructuredOutputsParams(json=OBJECT_SCHEMA)
    matcher = _compile(backend, spec).new_matcher()
    vocab = tokenizer.vocab_size
    for text in ("", '{"na', '{"name":"Bo', '{"name":"Bob","age":3', '{"name":"Bob","age":3}'):
        matcher.reset()
        assert matcher.accept_tokens(_ids(tokenizer, text))
        allowed = _allowed(matcher, vocab)
        valid = {t for t in range(vocab) if matcher.validate_tokens([t]) == 1}
        assert allowed == valid, text
        assert allowed, text


def test_bitmask_layout_and_width(tokenizer: Tokenizer) -> None:
    """Bit j of word w is token 32*w+j; ids past the tokenizer are never allowed."""
    wide = OutlinesBackend(tokenizer, tokenizer.vocab_size + 100)
    matcher = wide.compile(StructuredOutputsParams(choice=["1"])).new_matcher()
    (one,) = _ids(tokenizer, "1")
    bitmask = allocate_bitmask(3, wide.vocab_size)
    assert bitmask.shape[1] == bitmask_width(tokenizer.vocab_size + 100)
    matcher.fill_bitmask(bitmask, 1)
    words = bitmask[1].numpy().view("uint32")
    assert int(words[one >> 5]) == 1 << (one & 31)
    assert int(words.sum()) == 1 << (one & 31)
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
    assert matcher.validate_tokens([tokenizer.vocab_size + 5]) == 0


def test_vocab_size_smaller_than_tokenizer(tokenizer: Tokenizer) -> None:
    small = OutlinesBackend(tokenizer, 1000)
    matcher = small.compile(StructuredOutputsParams(regex="[a-z]+")).new_matcher()
    assert max(_allowed(matcher, 1000)) < 1000
    assert matcher.validate_tokens([5000]) == 0


def test_fill_bitmask_rejects_bad_tensors(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    matcher = _compile(backend, StructuredOutputsParams(regex="a")).new_matcher()
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_bitmask(torch.zeros((1, bitmask_width(tokenizer.vocab_size))), 0)
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_bitmask(torch.zeros((1, 3), dtype=torch.int32), 0)


def test_accept_keeps_the_accepted_prefix(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    matcher = _compile(backend, StructuredOutputsParams(regex="[0-9]+")).new_matcher()
    tokens = [*_ids(tokenizer, "12"), *_ids(tokenizer, "a")]
    assert matcher.validate_tokens(tokens) == len(tokens) - 1
    assert not matcher.accept_tokens(tokens)
    assert matcher.accept_tokens([tokenizer.eos_token_ids[0]])  # "12" was kept


def test_rollback(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(regex="[a-z]{0,300}")
    matcher = _compile(backend, spec).new_matcher()
    text = "".join(chr(97 + (i * i * 7) % 26) for i in range(200))
    tokens = _ids(tokenizer, text)
    assert len(tokens) > 70  # longer than the guide's own rollback window
    vocab = tokenizer.vocab_size
    masks = []
    for token in tokens:
        masks.append(_allowed(matcher, vocab))
        assert matcher.accept_tokens([token])
    for back in (1, 5, len(tokens)):
        matcher.reset()
        matcher.accept_tokens(tokens)
        matcher.rollback(back)
        assert _allowed(matcher, vocab) == masks[len(tokens) - back]
    matcher.reset()
    matcher.accept_tokens([*tokens, tokenizer.eos_token_ids[0]])
    assert matcher.is_terminated()
    matcher.rollback(2)
    assert not matcher.is_terminated()
    assert _allowed(matcher, vocab) == masks[-1]
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(len(tokens))
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(-1)


def test_jump_forward_string(backend: OutlinesBackend, tokenizer: Tokenizer) -> None:
    matcher = _compile(backend, StructuredOutputsParams(json=OBJECT_SCHEMA)).new_matcher()
    assert matcher.jump_forward_string() == '{"name":"'
    assert matcher.accept_tokens(_ids(tokenizer, '{"name":"Bob"'))
    assert matcher.jump_forward_string() == ',"age":'
    assert matcher.accept_tokens(_ids(tokenizer, ',"age":3}'))
    assert matcher.jump_forward_string() == ""


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


# -- the enforcement table -----------------------------------------------------------------------

DRAFT7 = "http://json-schema.org/draft-07/schema#"
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
INTS = {"type": "array", "items": {"type": "integer"}}

# (keyword, schema, an instance the schema rejects but outlines accepts)
UNENFORCED_CASES: list[Any] = [
    ("minimum", {"type": "integer", "minimum": 3}, 1),
    ("maximum", {"type": "integer", "maximum": 3}, 5),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 3}, 3),
    ("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 3}, 3),
    ("multipleOf", {"type": "integer", "multipleOf": 2}, 3),
    ("not", {"type": "integer", "not": {"enum": [1]}}, 1),
    ("if", {"type": "integer", "if": {"enum": [1]}, "then": {"enum": [2]}}, 1),
    ("then", {"type": "integer", "if": {"enum": [1]}, "then": {"enum": [2]}}, 1),
    ("else", {"type": "integer", "if": {"enum": [1]}, "else": {"enum": [1]}}, 2),
    ("uniqueItems", {**INTS, "uniqueItems": True}, [1, 1]),
    ("contains", {**INTS, "contains": {"enum": [5]}}, [1]),
    ("minContains", {**INTS, "contains": {"enum": [5]}, "minContains": 2}, [5]),
    ("maxContains", {**INTS, "contains": {"enum": [5]}, "maxContains": 1}, [5, 5]),
    (
        "dependentRequired",
        {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
    ),
    (
        "dependentSchemas",
        {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1},
    ),
    (
        "dependencies",
        {"$schema": DRAFT7, "type": "object", "properties": AB, "dependencies": {"a": ["b"]}},
        {"a": 1},
    ),
    (
        "propertyNames",
        {
            "type": "object",
            "properties": {"ab": {"type": "integer"}},
            "propertyNames": {"maxLength": 1},
        },
        {"ab": 1},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "properties": {"ab": {"type": "integer"}},
            "patternProperties": {"^a": {"minimum": 5}},
        },
        {"ab": 1},
    ),
    ("minProperties", {"type": "object", "properties": AB, "minProperties": 1}, {}),
    ("maxProperties", {"type": "object", "properties": AB, "maxProperties": 1}, {"a": 1, "b": 2}),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        {"a": 1, "b": 2},
    ),
    (
        "$dynamicRef",
        {
            "$defs": {"s": {"$dynamicAnchor": "s", "type": "string"}},
            "type": "object",
            "properties": {"a": {"type": "integer", "$dynamicRef": "#s"}},
        },
        {"a": 1},
    ),
    (
        "$recursiveRef",
        {
            "$schema": "https://json-schema.org/draft/2019-09/schema",
            "type": "object",
            "properties": {"a": {"type": "integer", "$recursiveRef": "#"}},
        },
        {"a": 1},
    ),
    # conditional keywords, where they are not enforced
    ("pattern", {"type": "string", "pattern": "^a+$", "minLength": 1}, "b"),
    ("pattern", {"type": "string", "pattern": "^\\s$"}, "a"),
    ("format", {"type": "string", "format": "date"}, "x"),
    ("format", {"type": "string", "format": "uuid", "maxLength": 50}, "x"),
    (
        "allOf",
        {"properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]},
        {},
    ),
    (
        "required",
        {"type": "object", "required": ["x"], "additionalProperties": {"type": "integer"}},
        {},
    ),
    # outlines writes its any-value for these: an index of seconds
    pytest.param(
        "unevaluatedItems",
        {"type": "array", "unevaluatedItems": {"type": "integer"}},
        ["a"],
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "unevaluatedProperties",
        {"type": "object", "unevaluatedProperties": {"type": "integer"}},
        {"a": "x"},
        marks=pytest.mark.slow,
    ),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    ("minItems", {"prefixItems": [{"type": "integer"}], "minItems": 2}, [1]),
    (
        "maxItems",
        {"prefixItems": [{"type": "integer"}, {"type": "integer"}], "maxItems": 1},
        [1, 2],
    ),
]

# (keyword, schema, an instance the schema rejects and outlines rejects too)
ENFORCED_CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("type", {"type": "integer"}, "a"),
    ("enum", {"enum": ["a", "b"]}, "c"),
    ("const", {"const": "a"}, "b"),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": "x"}),
    (
        "required",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {},
    ),
    (
        "additionalProperties",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"a": 1, "b": 2},
    ),
    (
        "additionalProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"a": "x"},
    ),
    (
        "unevaluatedProperties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "unevaluatedProperties": False,
        },
        {"a": 1, "b": 2},
    ),
    ("items", INTS, ["a"]),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        ["a", 1],
    ),
    (
        "unevaluatedItems",
        {"prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
        [1, 2],
    ),
    ("minItems", {**INTS, "minItems": 2}, [1]),
    ("maxItems", {**INTS, "maxItems": 1}, [1, 2]),
    ("minLength", {"type": "string", "minLength": 2}, "a"),
    ("maxLength", {"type": "string", "maxLength": 2}, "abc"),
    ("pattern", {"type": "string", "pattern": "^[a-c]+$"}, "abd"),
    ("format", {"type": "string", "format": "uuid"}, "x"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, None),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, None),
    (
        "oneOf",
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ]
        },
        {"k": "c"},
    ),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            ]
        },
        {},
    ),
    (
        "$ref",
        {
            "$defs": {"i": {"type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/i"}},
            "required": ["a"],
        },
        {"a": "x"},
    ),
    # conditional keywords, where they are enforced
    (
        "minProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        {},
    ),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 0},
        {"a": 1},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "properties": {"b": {"type": "integer"}},
            "patternProperties": {"^a": {"type": "integer"}},
        },
        {"b": 1, "a": "x"},
    ),
]


def _unenforced(schema: Any) -> set[str]:
    """The keywords (without their detail) outlines would not enforce in ``schema``."""
    return {k.split(" (")[0] for k in check_outlines_schema(schema).unenforced}


def _ids_of(cases: list[Any]) -> list[str]:
    keywords = [case.values[0] if hasattr(case, "values") else case[0] for case in cases]
    return [f"{keyword}-{i}" for i, keyword in enumerate(keywords)]


@pytest.mark.parametrize(
    "keyword, schema, instance", UNENFORCED_CASES, ids=_ids_of(UNENFORCED_CASES)
)
def test_unenforced_keyword_evidence(
    backend: OutlinesBackend, tokenizer: Tokenizer, keyword: str, schema: Any, instance: Any
) -> None:
    validator_cls = validator_for(schema)
    validator_cls.check_schema(schema)
    assert not validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER).is_valid(instance)
    assert keyword in _unenforced(schema)
    reason = backend.unsupported_reason(StructuredOutputsParams(json=schema))
    assert reason is not None and keyword in reason
    spec = StructuredOutputsParams(json=schema, allow_unenforced=True)
    assert backend.unsupported_reason(spec) is None
    assert _accepts(backend, tokenizer, spec, _compact(instance))


@pytest.mark.parametrize("keyword, schema, instance", ENFORCED_CASES, ids=_ids_of(ENFORCED_CASES))
def test_enforced_keyword_evidence(
    backend: OutlinesBackend, tokenizer: Tokenizer, keyword: str, schema: Any, instance: Any
) -> None:
    validator_cls = validator_for(schema)
    validator_cls.check_schema(schema)
    assert not validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER).is_valid(instance)
    assert _unenforced(schema) == set()
    spec = StructuredOutputsParams(json=schema)
    assert backend.unsupported_reason(spec) is None
    assert not _accepts(backend, tokenizer, spec, _compact(instance))


def test_every_table_entry_has_evidence() -> None:
    unenforced = {_ids_of([case])[0].rsplit("-", 1)[0] for case in UNENFORCED_CASES}
    enforced = {k for k, _, _ in ENFORCED_CASES}
    assert not OUTLINES_ENFORCED_KEYWORDS & OUTLINES_UNENFORCED_KEYWORDS
    assert unenforced >= OUTLINES_UNENFORCED_KEYWORDS
    assert enforced >= OUTLINES_ENFORCED_KEYWORDS
    for keyword in OUTLINES_CONDITIONAL_KEYWORDS:
        assert keyword in unenforced and keyword in enforced, keyword


def test_vacuous_keywords_are_not_reported() -> None:
    assert _unenforced({"type": "string", "minimum": 3}) == set()
    assert _unenforced({"type": "integer", "then": {"minimum": 3}}) == set()
    assert _unenforced({"type": "array", "uniqueItems": False}) == set()
    assert _unenforced({"enum": ["a"], "minimum": 3}) == set()
    nested = {"type": "object", "properties": {"a": {"type": "number", "maximum": 1}}}
    assert _unenforced(nested) == {"maximum"}
    via_ref = {"$defs": {"n": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/n"}
    assert _unenforced(via_ref) == {"minimum"}
    unused = {"$defs": {"n": {"type": "integer", "minimum": 0}}, "type": "string"}
    assert _unenforced(unused) == set()


# -- shared schema data --------------------------------------------------------------------------

_SAMPLE_PER_FOLDER = {"schemastore": 60, "json-schema-test-suite": 150}
_SAMPLE_MAX_STATES = 1000  # keeps each index build well under a second


@pytest.mark.slow
def test_shared_data_sample(
    backend: OutlinesBackend, tokenizer: Tokenizer, shared_data: Path
) -> None:
    """A fixed sample of the shared schemas that outlines fully enforces: compiled, and every
    test instance tried (counts printed): no invalid instance may be accepted."""
    eos = tokenizer.eos_token_ids[0]
    start = time.perf_counter()
    totals = {"compiled": 0, "valid": 0, "valid_accepted": 0, "invalid": 0, "invalid_accepted": 0}
    for folder, quota in _SAMPLE_PER_FOLDER.items():
        files = sorted((shared_data / folder).glob("*.json"))
        candidates = []
        for path in files:
            case = json.loads(path.read_text())
            spec = StructuredOutputsParams(json=case["schema"])
            if backend.unsupported_reason(spec) is not None:
                continue
            if estimate_dfa_states(backend.regex_for(spec)) > _SAMPLE_MAX_STATES:
                continue
            candidates.append((path.name, case, spec))
        step = max(1, len(candidates) // quota)
        sample = candidates[::step][:quota]
        counts = dict.fromkeys(totals, 0)
        invalid_accepted = []
        for name, case, spec in sample:
            compiled = backend.compile(spec)
            counts["compiled"] += 1
            for test in case["tests"]:
                text = _compact(in_schema_order(case["schema"], test["data"]))
                matcher = compiled.new_matcher()
                accepted = matcher.accept_tokens([*_ids(tokenizer, text), eos])
                accepted = accepted and matcher.is_terminated()
                kind = "valid" if test["valid"] else "invalid"
                counts[kind] += 1
                counts[f"{kind}_accepted"] += int(accepted)
                if accepted and not test["valid"]:
                    invalid_accepted.append(f"{name}: {test['description']}")
        print(
            f"\n{folder}: {len(files)} files, {len(candidates)} fully enforced by outlines "
            f"within {_SAMPLE_MAX_STATES} states, sampled {len(sample)}: {counts}"
        )
        for line in invalid_accepted:
            print(f"  invalid accepted: {line}")
        assert counts["compiled"] == len(sample) > 0
        assert counts["valid_accepted"] > 0
        assert not invalid_accepted
        for key in totals:
            totals[key] += counts[key]
    print(f"total: {totals} in {time.perf_counter() - start:.1f} s")
