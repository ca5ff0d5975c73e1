"""The xgrammar backend: every spec kind, matcher semantics, batched masks, the enforcement table
(each entry shown with an instance), and a sweep over the shared schema data."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from grammar_testing import EOS, IM_START, VOCAB, allowed, compact, ids, schema_files

from baton.engine.core.fill_thread import FillThread
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import GrammarError, allocate_bitmask
from baton.grammar.schema.normalise import close_every_object, uses_keyword
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import (
    XGRAMMAR_ENFORCED_FORMATS,
    XGRAMMAR_ENFORCED_KEYWORDS,
    XGRAMMAR_UNENFORCED_FORMATS,
    XGRAMMAR_UNENFORCED_KEYWORDS,
    XGrammarBackend,
    XGrammarCompiledGrammar,
    bitmask_allowed,
    close_object_schemas,
    xgrammar_unenforced_keywords,
)
from baton.grammar.xgrammar.normal_form import xgrammar_normal_form


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


def compile_spec(backend: XGrammarBackend, **kwargs: Any) -> XGrammarCompiledGrammar:
    return backend.compile(StructuredOutputsParams(**kwargs))


def walk(tokenizer: Tokenizer, grammar: XGrammarCompiledGrammar, text: str) -> bool:
    """Whether the matcher takes ``text`` token by token and then EOS (which terminates it)."""
    matcher = grammar.new_matcher()
    for token in ids(tokenizer, text):
        if not matcher.accept_tokens([token]):
            return False
    return matcher.accept_tokens([EOS]) and matcher.is_terminated()


# ------------------------------------------------------------------------------------- kinds

STRUCTURAL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<call>"],
        "tags": [
            {
                "type": "tag",
                "begin": "<call>",
                "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                "end": "</call>",
            }
        ],
    },
}
LEGACY_STRUCTURAL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<call>", "schema": {"type": "integer"}, "end": "</call>"}],
    "triggers": ["<call>"],
}

KIND_CASES = [
    (
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        '{"a":12}',
        '{"a":"x"}',
    ),
    ({"json_object": True}, '{"k":{"n":[1,"x",null,true]}}', "[1]"),
    ({"regex": r"\d{3}-[a-z]+"}, "123-abc", "12-abc"),
    ({"choice": ("yes", "no", 'say "hi"')}, 'say "hi"', "yes!"),
    ({"grammar": 'root ::= "(" root ")" | "x"'}, "((x))", "((x)"),
    ({"structural_tag": STRUCTURAL_TAG}, "hello <call>42</call> bye", "hi <call>x</call>"),
    ({"structural_tag": json.dumps(LEGACY_STRUCTURAL_TAG)}, "a<call>7</call>", "a<call>?</call>"),
]


@pytest.mark.parametrize(("kwargs", "good", "bad"), KIND_CASES, ids=lambda c: str(c)[:24])
def test_every_kind_accepts_valid_and_rejects_invalid(
    backend: XGrammarBackend, tokenizer: Tokenizer, kwargs: dict, good: str, bad: str
) -> None:
    grammar = compile_spec(backend, **kwargs)
    assert grammar.backend_name == "xgrammar"
    assert walk(tokenizer, grammar, good)
    assert not walk(tokenizer, grammar, bad)


def test_eos_only_at_an_accepting_state(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = compile_spec(backend, regex="ab|abcd").new_matcher()
    assert EOS not in allowed(matcher)
    assert not matcher.accept_tokens([EOS])
    assert matcher.accept_tokens(ids(tokenizer, "ab"))
    assert EOS in allowed(matcher)  # "ab" may end here, or go on to "abcd"
    assert len(allowed(matcher)) > 1
    assert matcher.accept_tokens(ids(tokenizer, "cd"))
    assert allowed(matcher) == {EOS}
    assert not matcher.is_terminated()
    assert matcher.accept_tokens([EOS])
    assert matcher.is_terminated()
    # Terminated: nothing more is taken, the mask allows only EOS, nothing is forced.
    assert not matcher.accept_tokens(ids(tokenizer, "a"))
    assert allowed(matcher) == {EOS}
    assert matcher.jump_forward_string() == ""
    matcher.rollback(1)
    assert not matcher.is_terminated()


def test_control_tokens_are_never_allowed(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = compile_spec(backend, regex=r"[\s\S]*").new_matcher()
    mask = allowed(matcher)
    special = set(backend.vocab.special_ids) - {EOS}
    assert special and not mask & special
    assert EOS in mask and len(mask) > 40000
    assert not matcher.accept_tokens([IM_START])
    # The same text spelled with ordinary tokens is just text.
    spelled = ids(tokenizer, "<|") + ids(tokenizer, "im_start|>")
    assert not set(spelled) & special
    assert matcher.accept_tokens(spelled)


def test_padded_model_vocabulary(tokenizer: Tokenizer) -> None:
    padded = XGrammarBackend(tokenizer, VOCAB + 40)
    matcher = padded.compile(StructuredOutputsParams(regex=r"[\s\S]*")).new_matcher()
    bitmask = allocate_bitmask(1, VOCAB + 40)
    assert bitmask.shape == (1, (VOCAB + 40 + 31) // 32)
    matcher.fill_bitmask(bitmask, 0)
    mask = set(bitmask_allowed(bitmask, 0, VOCAB + 40))
    assert not mask & set(range(VOCAB, VOCAB + 40))
    assert not matcher.accept_tokens([VOCAB + 3])
    with pytest.raises(ValueError, match="bitmask"):
        matcher.fill_bitmask(allocate_bitmask(1, VOCAB), 0)
    with pytest.raises(ValueError, match="vocab_size"):
        XGrammarBackend(tokenizer, 0)
    with pytest.raises(ValueError, match="EOS"):
        XGrammarBackend(tokenizer, EOS)
    with pytest.raises(ValueError, match="max_threads"):
        XGrammarBackend(tokenizer, VOCAB, max_threads=0)


def test_accept_validate_rollback_reset(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = compile_spec(backend, regex="hello world|help").new_matcher()
    good = ids(tokenizer, "hello world")
    assert len(good) >= 2
    start = allowed(matcher)
    # All or nothing: a rejected token undoes the ones before it in the same call.
    assert not matcher.accept_tokens([*good, good[0]])
    assert allowed(matcher) == start
    assert matcher.validate_tokens([*good, good[0]]) == len(good)
    assert matcher.validate_tokens([*good, EOS]) == len(good) + 1
    assert allowed(matcher) == start and not matcher.is_terminated()
    assert matcher.accept_tokens(good[:1])
    after_one = allowed(matcher)
    assert matcher.accept_tokens(good[1:])
    matcher.rollback(len(good) - 1)
    assert allowed(matcher) == after_one
    matcher.rollback(0)
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(5)
    with pytest.raises(ValueError):
        matcher.rollback(-1)
    matcher.reset()
    assert allowed(matcher) == start
    assert matcher.accept_tokens(good + [EOS]) and matcher.is_terminated()
    matcher.reset()
    assert not matcher.is_terminated()


def test_jump_forward_string(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    matcher = compile_spec(backend, json=schema).new_matcher()
    assert matcher.jump_forward_string() == '{"name":"'
    assert matcher.accept_tokens(ids(tokenizer, '{"name":"x"'))
    assert matcher.jump_forward_string() == "}"


def test_choice_is_exactly_the_strings(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    choices = ("a", 'q"uote', "back\\slash", "new\nline", "tab\t", "é😀", "<|end|>", "")
    grammar = compile_spec(backend, choice=choices)
    for choice in choices:
        assert walk(tokenizer, grammar, choice), repr(choice)
    for other in ("b", "aa", 'q\\"uote', "back\\\\slash", "new\\nline", " a"):
        assert not walk(tokenizer, grammar, other), repr(other)


def test_compile_errors_name_the_kind(backend: XGrammarBackend) -> None:
    cases = [
        ({"regex": "(?=a)b"}, "regex spec: .*Lookahead"),
        ({"grammar": "root ::= undefined_rule"}, "grammar spec: .*undefined_rule"),
        ({"json": {"enum": []}}, "json spec: .*enum"),
        ({"json": "{not json"}, "json spec: .*not valid JSON"),
        ({"json": {"type": "string", "pattern": "\\p{L}"}}, "json spec: .*Unicode"),
        ({"structural_tag": {"type": "nope"}}, "structural_tag spec"),
    ]
    for kwargs, message in cases:
        with pytest.raises(GrammarError, match=message):
            backend.compile(StructuredOutputsParams(**kwargs))


# -------------------------------------------------------------------------------- whitespace


def test_compact_and_any_whitespace(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    space, newline = ids(tokenizer, " ")[0], ids(tokenizer, "\n")[0]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compact_m = compile_spec(backend, json=schema).new_matcher()
    assert compact_m.accept_tokens(ids(tokenizer, "{"))
    assert not allowed(compact_m) & {space, newline}
    assert not walk(tokenizer, compile_spec(backend, json=schema), '{"a": 1}')
    assert walk(tokenizer, compile_spec(backend, json=schema), '{"a":1}')

    loose = compile_spec(backend, json=schema, whitespace="any", max_whitespace_cnt=2)
    matcher = loose.new_matcher()
    assert matcher.accept_tokens(ids(tokenizer, "{"))
    assert {space, newline} <= allowed(matcher)
    assert matcher.accept_tokens([space, newline])
    assert not allowed(matcher) & {space, newline}  # the cap: two in a row
    assert walk(tokenizer, loose, '{ "a" :  1 }')
    assert not walk(tokenizer, loose, '{"a":   1}')
    obj = compile_spec(backend, json_object=True)
    assert not walk(tokenizer, obj, '{"a": 1}')
    assert walk(tokenizer, compile_spec(backend, json_object=True, whitespace="any"), '{"a": 1}')


def test_disable_additional_properties(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object"}, "ref": {"$ref": "#/$defs/open"}},
        "additionalProperties": {"type": "integer"},
        "$defs": {"open": {"type": ["object", "null"]}},
    }
    text = '{"inner":{"x":1},"extra":2}'
    assert walk(tokenizer, compile_spec(backend, json=schema, open_objects=True), text)
    # The default closes objects that declare names: "inner" declares none, any object.
    assert walk(tokenizer, compile_spec(backend, json=schema), text)
    # vLLM's option closes every object.
    closed = compile_spec(backend, json=schema, disable_additional_properties=True)
    assert not walk(tokenizer, closed, text)
    assert not walk(tokenizer, closed, '{"inner":{"x":1}}')
    assert walk(tokenizer, closed, '{"inner":{},"extra":2}')  # its own setting stays
    assert "additionalProperties" not in close_object_schemas(schema)["properties"]["inner"]
    copy_ = close_every_object(schema)
    assert copy_["properties"]["inner"]["additionalProperties"] is False
    assert copy_["$defs"]["open"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["$defs"]["open"]  # the original is untouched


# ------------------------------------------------------------------------------------ batching


@pytest.mark.parametrize(
    ("parallel_from", "off_thread"),
    [(1, False), (128, False), (1, True)],
    ids=["threads", "one-thread", "on-the-fill-thread"],
)
def test_batch_fill_equals_single_fills(
    tokenizer: Tokenizer, parallel_from: int, off_thread: bool
) -> None:
    backend = XGrammarBackend(tokenizer, VOCAB, parallel_fill_min_rows=parallel_from)
    specs = [
        ({"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}, '{"n":1'),
        ({"json_object": True}, '{"a":['),
        ({"regex": "[a-z]+@[a-z]+"}, "abc@"),
        ({"choice": ("alpha", "beta")}, "al"),
        ({"grammar": 'root ::= ("a" | "b")+'}, "ab"),
        ({"regex": "x"}, "x"),
        ({"json": {"type": "array", "items": {"type": "string"}}}, ""),
    ]
    matchers = []
    for kwargs, prefix in specs:
        matcher = compile_spec(backend, **kwargs).new_matcher()
        assert matcher.accept_tokens(ids(tokenizer, prefix))
        matchers.append(matcher)
    matchers[5].accept_tokens([EOS])  # a terminated one in the batch
    rows = [6, 0, 3, 8, 1, 4, 7]
    batch = allocate_bitmask(9, VOCAB)
    if off_thread:  # as the engine fills a deferred step beside scheduling the next
        filler = FillThread()
        try:
            errors = filler.start([backend.plan_fill(matchers, batch, rows, off_thread=True)])
            assert errors.wait() == {}
        finally:
            filler.shutdown()
    else:
        backend.fill_bitmasks(matchers, batch, rows)
    single = allocate_bitmask(9, VOCAB)
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill_bitmask(single, row)
    assert torch.equal(batch, single)
    for untouched in (2, 5):
        assert bool((batch[untouched] == -1).all())
    assert len({tuple(batch[r].tolist()) for r in rows}) == len(rows)

    with pytest.raises(TypeError):
        backend.fill_bitmasks([object()], batch, [0])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        backend.fill_bitmasks(matchers[:1], batch.to(torch.int64), [0])
    with pytest.raises(ValueError):
        backend.fill_bitmasks(matchers[:2], batch, [0])


def test_concurrent_compiles(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    texts = [str(10**i) for i in range(8)]
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        grammar = backend.compile(StructuredOutputsParams(json={"type": "integer", "minimum": i}))
        results[i] = walk(tokenizer, grammar, texts[i]) and not walk(tokenizer, grammar, "-1")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == dict.fromkeys(range(8), True)


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

VALIDATORS = {
    "7": jsonschema.Draft7Validator,
    "2019-09": jsonschema.Draft201909Validator,
    "2020-12": jsonschema.Draft202012Validator,
}


def accepts(
    backend: XGrammarBackend,
    tokenizer: Tokenizer,
    schema: Any,
    value: Any,
    open_objects: bool = False,
) -> bool:
    spec = compile_spec(backend, json=schema, open_objects=open_objects)
    return walk(tokenizer, spec, compact(value))


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


# ------------------------------------------------------------------------- shared schema data


def _deref(schema: Any, root: Any) -> Any:
    for _ in range(32):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#")):
            break
        schema = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            schema = schema.get(part) if isinstance(schema, dict) else None
    return schema


def _branches(schema: Any) -> list[Any]:
    out = []
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out.extend(schema[key])
    return out


def _property_order(schema: Any, root: Any) -> list[str]:
    schema = _deref(schema, root)
    if not isinstance(schema, dict):
        return []
    props = schema.get("properties")
    order = list(props) if isinstance(props, dict) else []
    for branch in _branches(schema):
        order += [k for k in _property_order(branch, root) if k not in order]
    return order


def _child(schema: Any, root: Any, key: str | int) -> Any:
    schema = _deref(schema, root)
    if not isinstance(schema, dict):
        return {}
    if isinstance(key, str):
        props = schema.get("properties")
        if isinstance(props, dict) and key in props:
            return props[key]
        extra = schema.get("additionalProperties")
    else:
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list) and key < len(prefix):
            return prefix[key]
        extra = schema.get("items")
    if isinstance(extra, dict):
        return extra
    for branch in _branches(schema):
        found = _child(branch, root, key)
        if found != {}:
            return found
    return {}


def in_schema_order(value: Any, schema: Any, root: Any) -> Any:
    """``value`` with every object's keys in its schema's ``properties`` order (xgrammar
    generates properties in declared order only); unknown keys go last."""
    if isinstance(value, dict):
        rank = {k: i for i, k in enumerate(_property_order(schema, root))}
        keys = sorted(value, key=lambda k: rank.get(k, len(rank)))
        return {k: in_schema_order(value[k], _child(schema, root, k), root) for k in keys}
    if isinstance(value, list):
        return [in_schema_order(v, _child(schema, root, i), root) for i, v in enumerate(value)]
    return value


@pytest.fixture(scope="module")
def lazy_backend(tokenizer: Tokenizer) -> XGrammarBackend:
    # Same grammars; token-mask caches built on first use, so compiling all 733 schemas takes
    # seconds rather than minutes (a few schemastore schemas take 5-30 s each eagerly).
    return XGrammarBackend(tokenizer, VOCAB, dynamic_compilation=True)


@pytest.mark.slow
def test_shared_schema_data(
    lazy_backend: XGrammarBackend, tokenizer: Tokenizer, shared_data: Path
) -> None:
    files = schema_files(shared_data)
    assert len(files) > 100
    n_schemas = compiled = valid = valid_ok = reordered = invalid = invalid_ok = 0
    unexplained: list[str] = []
    t0 = time.perf_counter()
    for path in files:
        case = json.loads(path.read_text())
        schema = case["schema"]
        n_schemas += 1
        try:
            # json=False (the schema "false") reads as "no json given": ValueError.
            grammar = lazy_backend.compile(StructuredOutputsParams(json=schema))
        except (GrammarError, ValueError):
            continue
        compiled += 1
        flagged = xgrammar_unenforced_keywords(schema)
        for test in case["tests"]:
            data = test["data"]
            ok = walk(tokenizer, grammar, compact(data))
            if not ok:
                ordered = in_schema_order(data, schema, schema)
                ok = compact(ordered) != compact(data) and walk(
                    tokenizer, grammar, compact(ordered)
                )
                reordered += ok and test["valid"]
            if test["valid"]:
                valid += 1
                valid_ok += ok
            else:
                invalid += 1
                invalid_ok += ok
                # Every invalid instance xgrammar takes is explained by the table (or by oneOf,
                # which it treats as anyOf).
                if ok and not flagged and "oneOf" not in json.dumps(schema):
                    unexplained.append(f"{path.name}: {test['description']}")
    seconds = time.perf_counter() - t0
    print(
        f"\nxgrammar shared data: compiled {compiled}/{n_schemas} schemas, "
        f"valid accepted {valid_ok}/{valid} ({reordered} after reordering keys to schema order), "
        f"invalid accepted {invalid_ok}/{invalid}; {seconds:.1f} s"
    )
    assert compiled >= 0.9 * n_schemas
    # Measured: 680/733 compile, 1313/1618 valid accepted. The rest are xgrammar being stricter
    # than JSON Schema (strict mode forbids undeclared keys, untyped schemas get a type, patterns
    # are anchored, 2.0 is not an integer), never unsound.
    assert valid_ok >= 0.75 * valid
    assert not unexplained, unexplained


def test_eager_compile_of_the_test_suite(
    backend: XGrammarBackend, lazy_backend: XGrammarBackend, shared_data: Path
) -> None:
    # The eager path compiles the same set as the lazy one (the test-suite schemas are small).
    eager = lazy = 0
    for path in sorted((shared_data / "json-schema-test-suite").glob("*.json")):
        schema = json.loads(path.read_text())["schema"]
        if schema is False:  # the spec cannot say "false"; xgrammar rejects it anyway
            continue
        spec = StructuredOutputsParams(json=schema)
        for b in (backend, lazy_backend):
            try:
                b.compile(spec)
            except GrammarError:
                continue
            if b is backend:
                eager += 1
            else:
                lazy += 1
    assert eager == lazy > 250


def test_length_bounded_strings_never_hold_control_characters(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 4}},
        "required": ["name"],
    }
    grammar = compile_spec(backend, json=schema)
    assert walk(tokenizer, grammar, '{"name":"Nik"}')
    assert not walk(tokenizer, grammar, '{"name":"Ni\x15"}')
    assert not walk(tokenizer, grammar, '{"name":"Ni\\n"}')  # escapes are left out too
    assert not walk(tokenizer, grammar, '{"name":"a\\"b"}')
    # Still bounded, in code points as JSON Schema counts them.
    assert not walk(tokenizer, grammar, '{"name":"Nikos"}')
    assert not walk(tokenizer, grammar, '{"name":""}')
    assert walk(tokenizer, grammar, '{"name":"Éçü€"}')
    assert not walk(tokenizer, grammar, '{"name":"Éçü€a"}')


# ------------------------------------------------------------------------ structural tags


def _call_tag(schema: Any, **content: Any) -> dict[str, Any]:
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<call>"],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<call>",
                    "content": {"type": "json_schema", "json_schema": schema, **content},
                    "end": "</call>",
                }
            ],
        },
    }


def test_structural_tag_json_contents_compile_like_json_specs(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 4}},
        "required": ["name"],
    }
    tag = _call_tag(schema)
    grammar = compile_spec(backend, structural_tag=tag)
    assert walk(tokenizer, grammar, 'hi <call>{"name":"Nik"}</call> bye')
    # Compact by default, as a json spec: no free whitespace, no raw control characters in a
    # bounded string, and strict mode (no extra keys beside declared properties).
    assert not walk(tokenizer, grammar, '<call>{"name": "Nik"}</call>')
    assert not walk(tokenizer, grammar, '<call>{"name":"N\x15"}</call>')
    assert not walk(tokenizer, grammar, '<call>{"name":"N","x":1}</call>')
    assert not walk(tokenizer, grammar, '<call>{"name":"Nikos"}</call>')
    loose = compile_spec(backend, structural_tag=tag, whitespace="any", max_whitespace_cnt=2)
    assert walk(tokenizer, loose, '<call>{ "name": "Nik" }</call>')
    # A content with xgrammar's own options is left to xgrammar.
    own = compile_spec(backend, structural_tag=_call_tag(schema, max_whitespace_cnt=3))
    assert walk(tokenizer, own, '<call>{"name": "Nik"}</call>')


def test_structural_tag_unsupported_reason(backend: XGrammarBackend) -> None:
    spec = StructuredOutputsParams
    assert backend.unsupported_reason(spec(structural_tag=_call_tag({"type": "integer"}))) is None
    bad = _call_tag({"type": "array", "uniqueItems": True})
    reason = backend.unsupported_reason(spec(structural_tag=bad))
    assert reason is not None and "uniqueItems" in reason and "structural tag" in reason
    assert backend.unsupported_reason(spec(structural_tag=bad, allow_unenforced=True)) is None
    legacy = {"structures": [{"begin": "<a>", "schema": {"not": {}}, "end": "</a>"}]}
    reason = backend.unsupported_reason(spec(structural_tag=legacy))
    assert reason is not None and "not" in reason


def test_unbounded_strings_take_every_json_escape_and_no_other(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    # The escape is written out in baton's string rule (grammar/xgrammar/rewrites.py).
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    for kind in ({"json": schema}, {"json_object": True}):
        grammar = compile_spec(backend, **kind)  # type: ignore[arg-type]
        for text in ('\\"', "\\\\", "\\/", "\\b\\f\\n\\r\\t", "\\u00e9\\uABcd", "a\\nb\\\\c"):
            assert walk(tokenizer, grammar, '{"s":"' + text + '"}'), (kind, text)
        for text in ("\\x41", "\\u12", "\\u12g4", "\\", "a\\ b", "\x01"):
            assert not walk(tokenizer, grammar, '{"s":"' + text + '"}'), (kind, text)


def test_the_rewrites_keep_xgrammars_masks(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    # Without length bounds the rewritten grammar has xgrammar's language: the same mask at
    # every state (with them it is narrower, tested above).
    import xgrammar as xgr

    from baton.grammar.xgrammar.rewrites import rewrite_json_ebnf

    schema = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}},
            "when": {"type": "string", "format": "date-time"},
        },
        "additionalProperties": {"type": "string"},
    }
    options = {"any_whitespace": False, "separators": (",", ":")}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **options)
    assert rewrite_json_ebnf(str(grammar)) != str(grammar)
    ours = compile_spec(backend, json=schema)
    theirs = xgr.GrammarCompiler(backend.tokenizer_info, cache_enabled=False).compile_grammar(
        grammar
    )
    value = {
        "text": 'a "quote", a \\ and\nnew \u00e9 lines',
        "tags": ["ab", "c"],
        "when": "2024-01-02T03:04:05Z",
        "x-extra": "tab\there",
    }
    tokens = ids(tokenizer, compact(value)) + [EOS]
    mine, raw = ours.new_matcher(), xgr.GrammarMatcher(theirs)
    a, b = allocate_bitmask(1, VOCAB), allocate_bitmask(1, VOCAB)
    for token in tokens:
        mine.fill_bitmask(a, 0)
        raw.fill_next_token_bitmask(b, 0)
        assert torch.equal(a, b)
        assert mine.accept_tokens([token]) and raw.accept_token(token)
    assert mine.is_terminated()


@pytest.mark.parametrize(
    ("pattern", "valid", "invalid"),
    [
        # xgrammar 0.2.9 read each of these optional groups as if only its first element were
        # optional: "^(?:xa*)?$" accepted "a".
        ("^(?:xa*)?$", ["", "x", "xaa"], ["a", "aa"]),
        ("^v(?:-[a-z]+)?$", ["v", "v-beta"], ["vbeta", "v-"]),
        ("^([0-9]+(\\.[0-9]+)?)?s$", ["s", "1s", "1.5s"], [".5s", "1.s"]),
        ("^(?:a(?:b|c)+)??d$", ["d", "abd", "acbd"], ["bd", "cd"]),
    ],
)
def test_optional_groups_in_patterns_keep_their_language(
    backend: XGrammarBackend, tokenizer: Tokenizer, pattern: str, valid: list, invalid: list
) -> None:
    schema = {"type": "string", "pattern": pattern}
    for text in valid:
        assert re.search(pattern, text) and accepts(backend, tokenizer, schema, text), text
    for text in invalid:
        assert not re.search(pattern, text), text
        assert not accepts(backend, tokenizer, schema, text), text
    # As a patternProperties key too.
    keyed = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    assert accepts(backend, tokenizer, keyed, {valid[-1]: 1})
    assert not accepts(backend, tokenizer, keyed, {invalid[0]: 1})


def test_patterns_counting_past_128_are_rebuilt_and_keep_their_language(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    import xgrammar as xgr

    from baton.grammar.xgrammar.patterns import plain_class, rewrite_counted_patterns

    # Classes keep only plain JSON string characters; a class with none is not rebuilt.
    assert plain_class("a-z") == "[a-z]"
    assert plain_class("\\0-\\U0010ffff") == '[^\\x00-\\x1f"\\x5c]'
    assert plain_class('^"') == '[^\\x00-\\x1f"\\x5c]'
    with pytest.raises(Exception, match="no plain character"):
        plain_class('"\\\\')
    small = str(xgr.Grammar.from_json_schema('{"type": "string", "pattern": "^[a-z]{0,128}$"}'))
    assert rewrite_counted_patterns(small) == small
    big = str(xgr.Grammar.from_json_schema('{"type": "string", "pattern": "^[a-z]{0,129}$"}'))
    assert "Regex" in big and "Regex" not in rewrite_counted_patterns(big)

    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z][a-z0-9._-]{0,254}$"},
            "mail": {"type": "string", "pattern": '^[^\\s@"]{1,64}@[^\\s@]{1,255}$'},
            "dotted": {"type": "string", "pattern": "^([a-z]+\\.){1,3}[a-z]{1,300}$"},
        },
        "required": ["id", "mail", "dotted"],
        "additionalProperties": False,  # as xgrammar's strict mode reads it, for the masks below
    }
    grammar = compile_spec(backend, json=schema)
    value = {"id": "a" + "b" * 254, "mail": "ada@example.org", "dotted": "a.bc.def"}
    assert walk(tokenizer, grammar, compact(value))
    for bad in ({"id": "a" + "b" * 255}, {"id": "9ab"}, {"mail": "a@b@c"}, {"dotted": "abc"}):
        assert not walk(tokenizer, grammar, compact({**value, **bad})), bad
    # Plain characters only, as in length-bounded strings: a newline escape is refused.
    assert not walk(tokenizer, grammar, compact({**value, "mail": "a\nb@example.org"}))
    # Elsewhere the masks are xgrammar's own, state by state.
    options = {"any_whitespace": False, "separators": (",", ":")}
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **options)
    theirs = xgr.GrammarCompiler(backend.tokenizer_info, cache_enabled=False).compile_grammar(raw)
    mine, ref = grammar.new_matcher(), xgr.GrammarMatcher(theirs)
    a, b = allocate_bitmask(1, VOCAB), allocate_bitmask(1, VOCAB)
    for token in ids(tokenizer, compact({**value, "id": "ab.c-9"})) + [EOS]:
        mine.fill_bitmask(a, 0)
        ref.fill_next_token_bitmask(b, 0)
        # Narrower only: where xgrammar allows a token with an escape, baton may not.
        assert torch.equal(a & b, a)
        assert mine.accept_tokens([token]) and ref.accept_token(token)


DRAFT_FORMS = [
    # (schema, draft, valid instances, invalid instances)
    ({"type": "object", "propertyNames": True}, "2020-12", [{"a": 1}, {}], []),
    ({"type": "object", "propertyNames": False}, "2020-12", [{}], [{"a": 1}]),
    (
        {"type": "array", "items": [{"type": "integer"}, {"enum": ["x", "y"]}]},
        "7",
        [[1, "x"], [1], [], [2, "y", "anything", None]],
        [["x"], [1, "z"]],
    ),
    (
        {"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}},
        "7",
        [[1, "a", "b"], [1]],
        [[1, 2], ["a"]],
    ),
    (
        {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
        "2019-09",
        [[1], []],
        [[1, 2]],
    ),
    # No items: any item (xgrammar's strict mode alone allowed [] only, and with minItems
    # refused to compile).
    ({"type": "array", "minItems": 1}, "2020-12", [[1], ["a", {"b": [None]}, 2.5]], [[]]),
    ({"type": "array", "maxItems": 2}, "2020-12", [[], [{"k": "v"}, [1]]], [[1, 2, 3]]),
    ({"type": ["array", "null"], "minItems": 2}, "2020-12", [None, [1, "x"]], [[1], "x"]),
    ({"minItems": 2}, "2020-12", [[True, False], "text", 3], [[1]]),
    # A property whose schema is false may not appear (xgrammar refuses a false schema).
    (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": False}},
        "2020-12",
        [{"a": 1}, {}],
        [{"a": 1, "b": 2}, {"b": None}],
    ),
    ({"properties": {"a": True, "b": False}}, "2020-12", [{"a": [1]}, {}, 7], [{"b": 1}]),
    # No additionalProperties and no declared property: any name, with any value (strict
    # mode alone allowed {} only).
    (
        {"type": "object", "minProperties": 1},
        "2020-12",
        [{"k": 1}, {"a": [1], "b": None}],
        [{}, []],
    ),
    ({"type": "object", "maxProperties": 1}, "2020-12", [{}, {"k": [1]}], [{"k": 1, "l": 2}]),
    # Untyped object and array keywords apply to objects and arrays only (xgrammar built
    # such a schema for that type alone).
    (
        {"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        "2020-12",
        [{"a": 1}, {}, "text", 2.5, None, [1, "x"], True],
        [{"a": "x"}, {"b": 1}],
    ),
    ({"items": {"type": "integer"}}, "2020-12", [[1, 2], {"a": "x"}, "s", 0], [["x"]]),
    # An untyped branch under a typed parent keeps the parent's type (not split again).
    (
        {"type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}}]},
        "2020-12",
        [{"a": 1}, {}],
        [{"a": "x"}, 1],
    ),
    ({"unevaluatedItems": False}, "2020-12", [[], 1, "s", {"a": [1]}], [[1]]),
    ({"unevaluatedProperties": False}, "2020-12", [{}, [1], "s", None], [{"a": 1}]),
    # Items past prefixItems: any, unless items says otherwise.
    (
        {"type": "array", "prefixItems": [{"type": "integer"}]},
        "2020-12",
        [[], [1], [1, "x", None]],
        [["x"], ["x", 1]],
    ),
    # A pattern (and a patternProperties key) is a search: an unanchored side takes any text
    # (xgrammar matched it against the whole string).
    (
        {"type": "string", "pattern": "^https?://"},
        "2020-12",
        ["https://example.org/a?b=c", "http://"],
        ["ftp://x", "xhttps://"],
    ),
    ({"type": "string", "pattern": "a+|^z$"}, "2020-12", ["xxaayy", "a", "z"], ["xyz", "", "zz"]),
    (
        {"type": "object", "patternProperties": {"^v": {"type": "integer"}}},
        "2020-12",
        [{"vroom": 1}, {"v": 2}, {}],
        [{"vroom": "x"}],
    ),
    # Left closed (a narrowing, never a widening): declared properties (a declared name JSON
    # escapes would come in again as another name), and an object whose
    # unevaluatedProperties an additionalProperties would switch off.
    (
        {"type": "object", "properties": {"foo\nbar": {"type": "number"}}},
        "2020-12",
        [{"foo\nbar": 1}, {}],
        [{"foo\nbar": "1"}],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {}}}},
            "unevaluatedProperties": False,
        },
        "2020-12",
        [{"a": {"b": 1}}, {}],
        [{"a": 1}, {"c": 1}],
    ),
]


@pytest.mark.parametrize(("schema", "draft", "valid", "invalid"), DRAFT_FORMS, ids=str)
def test_draft_forms_and_arrays_without_items_are_enforced(
    backend: XGrammarBackend,
    tokenizer: Tokenizer,
    schema: dict[str, Any],
    draft: str,
    valid: list[Any],
    invalid: list[Any],
) -> None:
    # xgrammar refuses the draft forms ("propertyNames must be an object", "items must be a
    # boolean or an object") and narrows an array without items: baton hands it forms that mean
    # what the schema says. An object without declared properties is read as JSON Schema
    # reads it (open_objects: closed, it would admit {} only); the others closed, the default
    # (their valid instances here have no other names).
    open_ = not uses_keyword(schema, "properties") and not uses_keyword(
        schema, "unevaluatedProperties"
    )
    validator = VALIDATORS[draft](schema)
    assert xgrammar_unenforced_keywords(xgrammar_normal_form(schema)) == set()
    for value in valid:
        assert validator.is_valid(value), value
        assert accepts(backend, tokenizer, schema, value, open_), value
    for value in invalid:
        assert not validator.is_valid(value), value
        assert not accepts(backend, tokenizer, schema, value, open_), value


def test_strings_hold_no_utf8_surrogates(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    # xgrammar reads a negated class as any code point, surrogates included, spelt as bytes no
    # UTF-8 decoder takes (ED BD B0 came out in a maxLength 8 name at temperature 1): baton
    # adds U+D800-U+DFFF to every negated class (rewrite 6 of grammar/xgrammar/rewrites.py).
    # GPT-2's byte alphabet: bytes ED BD B0 are the tokens "í", "½", "°".
    surrogate = [tokenizer.token_strings().index(c) for c in ("í", "½", "°")]
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string", "maxLength": 8}},
    }
    grammar = compile_spec(backend, json=schema)
    for key in ("a", "b"):
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(ids(tokenizer, '{"' + key + '":"x'))
        assert not all(matcher.accept_tokens([t]) for t in surrogate), key
        # Valid two- and four-byte characters still pass, in both kinds of string.
        assert walk(tokenizer, grammar, '{"' + key + '":"\u07b8\U0001f600"}'), key
