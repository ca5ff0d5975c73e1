"""The xgrammar backend's structural tags, the schema rewrites that keep xgrammar's masks (JSON
escapes, optional groups, counted patterns, draft forms) and UTF-8 strings."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from grammar_testing import EOS, VOCAB, compact, ids
from xgrammar_testing import VALIDATORS, accepts, compile_spec, walk

from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import allocate_bitmask
from baton.grammar.schema.normalise import uses_keyword
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import XGrammarBackend, xgrammar_unenforced_keywords
from baton.grammar.xgrammar.normal_form import xgrammar_normal_form


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


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
