"""Tool calls as a constraint (the structural tag, compiled by xgrammar and walked token by
token) and back (the parser, whole and incremental)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.tool_calls import (
    HERMES,
    FunctionTool,
    ParsedToolCall,
    parse_tool_calls,
    tool_call_tag,
)
from baton.grammar.validation import validate_spec
from baton.grammar.xgrammar.backend import XGrammarBackend, bitmask_allowed

VOCAB = 49152
EOS = 2

WEATHER = FunctionTool(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
)
TIME = FunctionTool("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}})
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB)


def accepts(backend: XGrammarBackend, tokenizer: Tokenizer, tag: dict[str, Any], text: str) -> bool:
    """Whether the tag's grammar takes ``text`` and may then end."""
    spec = StructuredOutputsParams(structural_tag=tag)
    validate_spec(spec)
    matcher = backend.compile(spec).new_matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        bitmask = allocate_bitmask(1, VOCAB)
        matcher.fill_bitmask(bitmask, 0)
        if token not in bitmask_allowed(bitmask, 0, VOCAB) or not matcher.accept_tokens([token]):
            return False
    return matcher.accept_tokens([EOS])


def call(name: str, arguments: dict[str, Any]) -> str:
    return HERMES.render(name, json.dumps(arguments, separators=(",", ":")))


PARIS = call("get_weather", {"city": "Paris", "unit": "celsius"})
UTC = call("get_time", {"tz": "UTC"})


def test_required_admits_calls_only(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    tag = tool_call_tag(TOOLS, "required")
    assert accepts(backend, tokenizer, tag, PARIS)
    assert accepts(backend, tokenizer, tag, PARIS + "\n" + UTC)
    assert not accepts(backend, tokenizer, tag, "")
    assert not accepts(backend, tokenizer, tag, "Sure. " + PARIS)
    assert not accepts(backend, tokenizer, tag, call("get_weather", {"city": "Paris"}))
    assert not accepts(backend, tokenizer, tag, call("get_weather", {"city": "P", "unit": "K"}))
    assert not accepts(backend, tokenizer, tag, call("nope", {}))
    assert not accepts(
        backend, tokenizer, tag, call("get_weather", {"city": "A" * 13, "unit": "celsius"})
    )
    one = tool_call_tag(TOOLS, "required", parallel=False)
    assert accepts(backend, tokenizer, one, UTC)
    assert not accepts(backend, tokenizer, one, PARIS + "\n" + UTC)


def test_named_is_required_with_one_function(
    backend: XGrammarBackend, tokenizer: Tokenizer
) -> None:
    tag = tool_call_tag([TIME], "required", parallel=False)
    assert accepts(backend, tokenizer, tag, UTC)
    assert not accepts(backend, tokenizer, tag, PARIS)


def test_auto_admits_text_and_calls(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    tag = tool_call_tag(TOOLS, "auto")
    assert accepts(backend, tokenizer, tag, "Just text, no call.")
    assert accepts(backend, tokenizer, tag, "Let me look. " + PARIS + "\n" + UTC)
    # Past the trigger, only a well-formed call.
    assert not accepts(backend, tokenizer, tag, '<tool_call>\n{"name": "nope", "arguments": {}}')
    single = tool_call_tag(TOOLS, "auto", parallel=False)
    assert accepts(backend, tokenizer, single, PARIS)
    assert not accepts(backend, tokenizer, single, PARIS + "\n" + UTC)


def test_auto_with_an_answer_format(backend: XGrammarBackend, tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = {"type": "json_schema", "json_schema": schema}
    tag = tool_call_tag(TOOLS, "auto", answer=answer)
    assert accepts(backend, tokenizer, tag, PARIS)
    assert accepts(backend, tokenizer, tag, '{"a":1}')
    assert not accepts(backend, tokenizer, tag, "free text")
    assert not accepts(backend, tokenizer, tag, '{"b":1}')


def test_bad_tools() -> None:
    with pytest.raises(ValueError, match="function name"):
        FunctionTool("has space")
    with pytest.raises(ValueError, match="duplicate"):
        tool_call_tag([TIME, TIME], "auto")
    with pytest.raises(ValueError, match="at least one"):
        tool_call_tag([], "required")


def test_parse_whole_outputs() -> None:
    out = parse_tool_calls("plain answer \n", final=True)
    assert out.content == "plain answer \n" and out.tool_calls == ()
    out = parse_tool_calls("Let me check.  " + PARIS + "\n" + UTC, final=True)
    assert out.content == "Let me check."
    assert out.tool_calls == (
        ParsedToolCall("get_weather", '{"city":"Paris","unit":"celsius"}', True),
        ParsedToolCall("get_time", '{"tz":"UTC"}', True),
    )
    for c in out.tool_calls:
        jsonschema.validate(
            json.loads(c.arguments), {"get_weather": WEATHER, "get_time": TIME}[c.name].parameters
        )
    out = parse_tool_calls(PARIS + " and then some words ", final=True)
    assert out.content == "and then some words" and len(out.tool_calls) == 1
    # Cut by max_tokens inside a call: the call keeps what was written.
    cut = PARIS[:-20]
    out = parse_tool_calls(cut, final=True)
    assert out.tool_calls == (
        ParsedToolCall("get_weather", cut[len(HERMES.begin("get_weather")) :], False),
    )
    # Cut inside the end marker: the arguments are whole, and only they are kept.
    for k in range(1, len(HERMES.end)):
        out = parse_tool_calls(PARIS[:-k], final=True)
        assert out.tool_calls == (
            ParsedToolCall("get_weather", '{"city":"Paris","unit":"celsius"}', False),
        ), k
    # A closing brace that may end the arguments or start the marker: JSON decides.
    args = '{"tz":{"a":{}}}'
    nested = HERMES.render("get_time", args)
    for k in range(1, len(HERMES.end) + 4):
        (call,) = parse_tool_calls(nested[:-k], final=True).tool_calls
        whole = args if k <= len(HERMES.end) else args[: len(args) - (k - len(HERMES.end))]
        assert call.arguments == whole, k
    # Cut inside the header: no call, the text stays.
    out = parse_tool_calls('Hi <tool_call>\n{"na', final=True)
    assert out.content == 'Hi <tool_call>\n{"na' and out.tool_calls == ()


@pytest.mark.parametrize(
    "text",
    [
        "Let me check.  " + PARIS + "\n" + UTC,
        PARIS + "\nthen text\n" + UTC + "  tail ",
        "No calls at all, just < and <tool and }\n text. ",
        PARIS[:-7],
    ],
)
def test_incremental_parses_only_grow(text: str) -> None:
    """Every prefix's parse is a prefix of the next one's: what a stream sent stays true."""
    final = parse_tool_calls(text, final=True)
    prev_content, prev_calls = "", []
    for n in range(len(text) + 1):
        out = parse_tool_calls(text[:n], final=n == len(text))
        assert out.content.startswith(prev_content), (n, out.content, prev_content)
        assert len(out.tool_calls) >= len(prev_calls)
        for before, now in zip(prev_calls, out.tool_calls, strict=False):
            assert now.name == before.name and now.arguments.startswith(before.arguments)
        prev_content, prev_calls = out.content, list(out.tool_calls)
    assert (prev_content, tuple(prev_calls)) == (final.content, final.tool_calls)


def test_markers_become_their_tokens() -> None:
    """Marker texts with an id become token formats (the longest first), the text between
    them stays text; a tag keeps a leading marker as its begin token, a trailing one as its
    end token, and a begin or end without markers as it is."""
    from baton.grammar.tool_formats import MISTRAL
    from baton.grammar.tool_markers import bind_markers, literal_parts

    ids = {"<|start|>": 1, "<|start|>x": 2, "<tool_call>": 3, "</tool_call>": 4, "[TOOL_CALLS]": 5}
    assert literal_parts("a<|start|>b<|start|>x", ids) == [
        {"type": "const_string", "value": "a"},
        {"type": "token", "token": 1},
        {"type": "const_string", "value": "b"},
        {"type": "token", "token": 2},
    ]
    assert bind_markers({"type": "regex", "pattern": "<tool_call>"}, ids)["type"] == "regex"
    tag = tool_call_tag([TIME], "required", parallel=False, markers=ids)["format"]
    (call,) = tag["tags"]
    assert call["begin"] == {"type": "token", "token": 3}
    assert call["end"] == {"type": "token", "token": 4}
    assert call["content"]["elements"][0]["value"].startswith('\n{"name": "get_time"')
    block = tool_call_tag(TOOLS, "required", fmt=MISTRAL, markers=ids)["format"]
    assert block["begin"] == {"type": "token", "token": 5} and block["end"] == "]"
    # auto: free text without the trigger's text, each call opened by the trigger's token.
    calls, after = tool_call_tag(TOOLS, "auto", markers=ids)["format"]["elements"]
    assert after == {"type": "any_text", "excludes": ["<tool_call>"]}
    opened, call = calls["content"]["elements"]
    assert opened == {"type": "tag", "begin": "", "content": after, "end": ids_token(3)}
    assert [t["end"] for t in call["elements"]] == [ids_token(4)] * len(TOOLS)
    assert call["elements"][0]["begin"].startswith('\n{"name": "')
    text = tool_call_tag(TOOLS, "auto", markers={"</tool_call>": 4})["format"]
    assert text["triggers"] == ["<tool_call>"]  # a trigger without its token stays text


def ids_token(token_id: int) -> dict[str, object]:
    return {"type": "token", "token": token_id}


def test_harmony_tag_needs_its_markers() -> None:
    from baton.grammar.tool_calls import harmony_call_tag
    from baton.grammar.tool_formats import OPENAI

    ids = {m: i for i, m in enumerate(OPENAI.markers)}
    with pytest.raises(ValueError, match="missing <\\|call\\|>"):
        harmony_call_tag(TOOLS, {m: i for m, i in ids.items() if m != "<|call|>"})
    with pytest.raises(ValueError, match="needs mode 'auto'"):
        harmony_call_tag(TOOLS, ids, answer={"type": "json_schema", "json_schema": {}})
    with pytest.raises(ValueError, match=">= 0"):
        harmony_call_tag(TOOLS, ids, max_reasoning_tokens=-1)
    with pytest.raises(ValueError, match="duplicate"):
        harmony_call_tag([TIME, TIME], ids)
    validate_spec(StructuredOutputsParams(structural_tag=harmony_call_tag(TOOLS, ids, mode="auto")))
