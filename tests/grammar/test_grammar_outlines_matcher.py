"""The outlines-core backend: the spec kinds it compiles and refuses, and matcher semantics (EOS,
special tokens, masks, bitmask layout, accept, rollback, jump-forward)."""

from __future__ import annotations

import json

import pytest
import torch
from outlines_testing import _accepts, _compile, _ids

from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import GrammarError, allocate_bitmask, bitmask_width
from baton.grammar.outlines.backend import (
    OutlinesBackend,
    OutlinesMatcher,
    choice_regex,
    estimate_dfa_states,
)
from baton.grammar.spec import StructuredOutputsParams

OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> OutlinesBackend:
    return OutlinesBackend(tokenizer, tokenizer.vocab_size)


def _allowed(matcher: OutlinesMatcher, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].numpy().view("uint32")
    return {i for i in range(vocab_size) if (int(words[i >> 5]) >> (i & 31)) & 1}


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
