"""The xgrammar backend: every spec kind, matcher semantics, whitespace, batched masks and
concurrent compiles."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from grammar_testing import EOS, IM_START, VOCAB, allowed, ids
from xgrammar_testing import compile_spec, walk

from baton.engine.core.fill_thread import FillThread
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import GrammarError, allocate_bitmask
from baton.grammar.schema.normalise import close_every_object
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.xgrammar.backend import XGrammarBackend, bitmask_allowed, close_object_schemas


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


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
