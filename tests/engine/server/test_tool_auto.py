"""tool_choice "auto" where the format's trigger is one token of the vocabulary (Qwen's
``<tool_call>``, an added token; Mistral's ``[TOOL_CALLS]``, a control token): free text, then
a call opened by that token and held to one of the tools' schemas, then free text again. The
grammar is walked token by token on the tiny model's vocabulary with the markers added; the
server answers with text or calls whose arguments validate."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from test_tool_call_formats import (  # noqa: F401 - the tiny model with marker tokens
    BOUNDED,
    MARKERS,
    PARIS,
    SCHEMAS,
    TOOLS,
    UTC,
    marker_folder,
    marker_servers,
)

from baton.engine.server.constraints import Constraint
from baton.engine.server.errors import APIError
from baton.engine.server.tools import ToolPlan, tool_constraint
from baton.engine.tokenizer import Tokenizer
from baton.grammar.backend import allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.structural_tag import json_schema_formats
from baton.grammar.tool_calls import (
    HERMES,
    MISTRAL,
    QWEN3_CODER,
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    parse_tool_calls,
    tool_call_tag,
)
from baton.grammar.tool_formats import OPENAI
from baton.grammar.validation import validate_spec
from baton.grammar.xgrammar.backend import XGrammarBackend, bitmask_allowed

MARKER_FORMATS = [HERMES, MISTRAL, QWEN3_CODER]

Piece = str | list[int]
"""Text the tokenizer encodes (a marker's text becomes its token), or token ids as they are."""


@pytest.fixture(scope="module")
def marker_tokenizer(marker_folder: Any) -> Tokenizer:  # noqa: F811
    from baton.engine.loader import load_tokenizer

    return load_tokenizer(marker_folder)


@pytest.fixture(scope="module")
def marker_backend(marker_tokenizer: Tokenizer) -> XGrammarBackend:
    return XGrammarBackend(marker_tokenizer, marker_tokenizer.vocab_size)


def marker_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {m: tok.encode(m, add_special_tokens=False) for m in MARKERS}
    assert all(len(i) == 1 for i in ids.values())
    return {m: i[0] for m, i in ids.items()}


def spelled(tok: Tokenizer, text: str) -> list[int]:
    """``text`` in pieces of a character each: a marker in it spelled, not its token."""
    return [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]


def walk(
    backend: XGrammarBackend, tok: Tokenizer, tag: dict[str, Any], pieces: list[Piece]
) -> bool:
    """Whether the tag's grammar allows the tokens of ``pieces`` one by one (each in the
    mask before it is accepted) and may then end."""
    spec = StructuredOutputsParams(structural_tag=tag)
    validate_spec(spec)
    matcher = backend.compile(spec).new_matcher()
    tokens: list[int] = []
    for p in pieces:
        tokens += tok.encode(p, add_special_tokens=False) if isinstance(p, str) else p
    for token in tokens:
        bitmask = allocate_bitmask(1, tok.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        if token not in bitmask_allowed(bitmask, 0, tok.vocab_size):
            return False
        if not matcher.accept_tokens([token]):
            return False
    return matcher.accept_tokens([tok.eos_token_id])


def valid_calls(fmt: ToolCallFormat, text: str) -> list[str]:
    """The names of the calls in ``text``, each whole and its arguments valid."""
    out = parse_tool_calls(text, fmt, final=True, tools=TOOLS)
    for call in out.tool_calls:
        assert call.complete
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return [c.name for c in out.tool_calls]


@pytest.mark.parametrize("fmt", MARKER_FORMATS, ids=lambda f: f.name)
def test_auto_opens_calls_at_the_trigger_token(
    fmt: ToolCallFormat, marker_backend: XGrammarBackend, marker_tokenizer: Tokenizer
) -> None:
    tok, backend = marker_tokenizer, marker_backend
    markers = marker_ids(tok)
    auto = tool_call_tag(TOOLS, "auto", fmt=fmt, markers=markers)
    one = tool_call_tag(TOOLS, "auto", fmt=fmt, markers=markers, parallel=False)
    both = fmt.render_calls([PARIS, UTC])
    trigger = tok.encode(fmt.trigger, add_special_tokens=False)
    assert trigger == [markers[fmt.trigger]]
    # Free text, a call opened by the trigger's token (encode writes each marker as its
    # token), free text again; the calls parse back valid.
    for tag in (auto, one):
        assert walk(backend, tok, tag, ["Just text, no call."])
        text = "Let me look. " + fmt.render(*UTC) + " Done."
        assert walk(backend, tok, tag, [text])
        assert valid_calls(fmt, text) == ["get_time"]
    assert walk(backend, tok, auto, ["Let me look. " + both])
    assert valid_calls(fmt, both) == ["get_weather", "get_time"]
    if fmt is not MISTRAL:  # Mistral's one block holds every call
        twice = fmt.render(*UTC) + "\n" + fmt.render(*PARIS)
        assert walk(backend, tok, auto, [twice])
        assert not walk(backend, tok, one, [twice])
    else:
        assert not walk(backend, tok, one, ["Let me look. " + both])
        assert not walk(backend, tok, auto, [fmt.render(*UTC) + " and " + fmt.render(*UTC)])
    # After the trigger: the call's syntax and one of the tools' schemas, nothing else.
    wrong = fmt.render("get_weather", '{"city":"Paris","unit":"kelvin"}')
    missing = fmt.render("get_weather", '{"city":"Paris"}')
    unknown = fmt.render("get_date", "{}")
    for text in (wrong, missing, unknown, fmt.trigger + " is my answer"):
        assert not walk(backend, tok, auto, ["Let me look. " + text]), text
    # The trigger spelled in pieces would read as a call the grammar never checked.
    assert not walk(backend, tok, auto, ["Let me look. ", spelled(tok, fmt.render(*UTC))])
    assert not walk(backend, tok, auto, ["About ", spelled(tok, fmt.trigger), " tags."])


@pytest.mark.parametrize(
    ("fmt", "ends"),
    [(HERMES, ("</tool_call>",)), (MISTRAL, ()), (QWEN3_CODER, ("</tool_call>",))],
    ids=lambda v: v.name if isinstance(v, ToolCallFormat) else "",
)
def test_auto_over_http_calls_at_the_trigger_token(
    marker_servers: dict[str, str],  # noqa: F811
    marker_tokenizer: Tokenizer,
    fmt: ToolCallFormat,
    ends: tuple[str, ...],
) -> None:
    """Random weights at temperature 1, the trigger's token pushed up by logit_bias so the
    model opens a call, 3 seeds: one call whose arguments validate, the trigger and the end
    marker each written as their one token (the logprobs' tokens), never spelled; without
    the push the answer is text with no trigger in it."""
    trigger = marker_ids(marker_tokenizer)[fmt.trigger]
    tools = [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in BOUNDED.items()
    ]
    url = f"{marker_servers[fmt.name]}/v1/chat/completions"
    for seed in range(3):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": tools,
            "tool_choice": "auto",
            "max_tokens": 80,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": True,
            "parallel_tool_calls": False,
        }
        reply = httpx.post(url, json=body | {"logit_bias": {str(trigger): 100}}, timeout=120)
        assert reply.status_code == 200, reply.text
        out = reply.json()["choices"][0]
        calls = out["message"]["tool_calls"]
        assert len(calls) == 1, out
        function = calls[0]["function"]
        jsonschema.validate(json.loads(function["arguments"]), BOUNDED[function["name"]])
        tokens = [t["token"] for t in out["logprobs"]["content"]]
        for marker in (fmt.trigger, *ends):
            assert tokens.count(marker) == 1, (marker, tokens)
            assert "".join(tokens).count(marker) == 1, tokens  # no spelled copy
    plain = httpx.post(url, json=body | {"max_tokens": 24}, timeout=120).json()
    message = plain["choices"][0]["message"]
    if not message.get("tool_calls"):
        assert fmt.trigger not in (message["content"] or "")


@pytest.mark.parametrize("fmt", [*TOOL_CALL_FORMATS.values(), OPENAI], ids=lambda f: f.name)
def test_auto_is_never_left_unchecked_under_another_backend(fmt: ToolCallFormat) -> None:
    """Only xgrammar reads structural tags: tool_choice auto with another backend is a 400
    naming it (harmony's too, whose calls were left free before); auto picks xgrammar. With a
    response format, auto keeps both: calls only, or an answer in that format."""
    markers = tuple((m, i) for i, m in enumerate(fmt.markers, start=100))
    plan = ToolPlan((), tuple(TOOLS), tuple(TOOLS), "auto", True, fmt, markers)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for backend in ("guidance", "outlines"):
        answer = Constraint("response_format", StructuredOutputsParams(schema, backend=backend))
        for given, default in ((None, backend), (answer, "xgrammar")):
            with pytest.raises(APIError) as caught:
                tool_constraint(plan, given, default)
            error = caught.value
            assert error.status == 400 and error.param == "tools", error
            assert repr(backend) in str(error) and "xgrammar" in str(error)
    for backend in ("auto", "xgrammar"):
        answer = Constraint("response_format", StructuredOutputsParams(schema, backend=backend))
        both = tool_constraint(plan, answer, backend)
        assert both is not None and both.spec.backend == "xgrammar"
        tag = both.spec.structural_tag
        assert isinstance(tag, dict)
        schemas = [f["json_schema"] for f in json_schema_formats(tag)]
        assert schema in schemas and all(t.parameters in schemas for t in TOOLS)
