"""Every spelling of a constraint is enforced on both endpoints (OpenAI's response_format
forms, baton's structured_outputs, vLLM's guided_* fields), and every field baton does not
implement but that would change the answer is a 400 naming it, against ``baton serve`` on
the default model. Outputs are validated with ``jsonschema`` (or matched in full); the
constraints are ones the model would not meet by chance (a code pattern, an odd regex)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from serving import DEFAULT_SERVED_MODEL as MODEL

from baton.engine.loader import load_tokenizer
from baton.engine.server.constraints import request_constraint
from baton.engine.server.errors import APIError
from baton.engine.server.protocol import CompletionRequest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FILM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]$"},
    },
    "required": ["title", "year", "code"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{4}-[a-z]{2,5}"
CHOICES = ["alpha", "omega"]
GRAMMAR = 'root ::= "<" ("x" | "yy")+ ">"'
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Name a film and its year, as JSON."}],
    "max_tokens": 40,
    "temperature": 0,
}
COMPLETION = {
    "model": MODEL,
    "prompt": 'Films as JSON:\n{"title": "Alien", "year": 1979}\n',
    "max_tokens": 40,
    "temperature": 0,
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def film(text: str) -> None:
    jsonschema.validate(json.loads(text), FILM)


def any_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def choice(text: str) -> None:
    assert text in CHOICES


def grammar(text: str) -> None:
    assert re.fullmatch(r"<(x|yy)+>", text), text


SPELLINGS: dict[str, tuple[dict[str, Any], Callable[[str], None]]] = {
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "film", "schema": FILM, "strict": True},
            }
        },
        film,
    ),
    "json_schema-inline-schema": (
        {"response_format": {"type": "json_schema", "schema": FILM}},
        film,
    ),
    "json_object-with-schema": ({"response_format": {"type": "json_object", "schema": FILM}}, film),
    # Any object: the model decides when it ends, so it gets more room.
    "json_object": ({"response_format": {"type": "json_object"}, "max_tokens": 128}, any_object),
    "structured_outputs": ({"structured_outputs": {"json": FILM}}, film),
    "structured_outputs-vllm-options": (
        {
            "structured_outputs": {
                "json": FILM,
                "disable_any_whitespace": True,
                "whitespace_pattern": r"\s*",
                "disable_fallback": True,
            }
        },
        film,
    ),
    "guided_json": ({"guided_json": FILM}, film),
    "guided_json-text": ({"guided_json": json.dumps(FILM)}, film),
    "guided_regex": ({"guided_regex": REGEX}, regex),
    "guided_regex-outlines": (
        {"guided_regex": REGEX, "guided_decoding_backend": "outlines"},
        regex,
    ),
    "guided_choice": ({"guided_choice": CHOICES}, choice),
    "guided_grammar": ({"guided_grammar": GRAMMAR}, grammar),
    "guided_json-whitespace-pattern": (
        {"guided_json": FILM, "guided_whitespace_pattern": r"[ \n\t]*"},
        film,
    ),
    # Outlines' vLLM client: the schema as guided_json, the pattern at the top level.
    "outlines-whitespace-pattern": (
        {"guided_json": FILM, "whitespace_pattern": r"[ \n]?"},
        film,
    ),
    "same-constraint-twice": (
        {"guided_json": FILM, "response_format": {"type": "json_object", "schema": FILM}},
        film,
    ),
}
CASES = [(endpoint, name) for endpoint in PATHS for name in SPELLINGS]


@pytest.fixture(scope="module")
def answers(default_model_server: str) -> dict[tuple[str, str], httpx.Response]:
    """Every spelling on both endpoints, sent at once so that the engine batches them."""

    def send(case: tuple[str, str]) -> httpx.Response:
        endpoint, name = case
        base = CHAT if endpoint == "chat" else COMPLETION
        body = base | SPELLINGS[name][0]
        return httpx.post(f"{default_model_server}{PATHS[endpoint]}", json=body, timeout=550)

    with ThreadPoolExecutor(8) as pool:
        return dict(zip(CASES, pool.map(send, CASES), strict=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_every_spelling_is_enforced(
    answers: dict[tuple[str, str], httpx.Response], case: tuple[str, str]
) -> None:
    r = answers[case]
    assert r.status_code == 200, r.text
    (out,) = r.json()["choices"]
    text = out["message"]["content"] if case[0] == "chat" else out["text"]
    assert out["finish_reason"] == "stop", (out["finish_reason"], text)
    SPELLINGS[case[1]][1](text)


# ------------------------------------------------------------------------------ 400s

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def tool_with(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Valid JSON Schema that xgrammar cannot compile (a property that must be absent: a false
# subschema, where other names are allowed, so baton cannot leave it undeclared); outlines-core
# can.
FALSE_PROPERTY = {
    "type": "object",
    "properties": {"foo": {"type": "integer"}, "bar": False},
    "required": ["foo"],
    "additionalProperties": {"type": "integer"},
}

REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # (endpoint, fields, the param the 400 names, a word of its message)
    ("chat", {"functions": [{"name": "f"}]}, "functions", "tools"),
    ("chat", {"function_call": "auto"}, "function_call", "tool_choice"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "text"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "reasoning"),
    ("chat", {"verbosity": "low"}, "verbosity", "not supported"),
    ("chat", {"web_search_options": {}}, "web_search_options", "web search"),
    ("chat", {"frobnicate": 1}, "frobnicate", "unknown field"),
    ("chat", {"use_beam_search": True}, "use_beam_search", "beam"),
    ("chat", {"response_format": {"type": "grammar"}}, "response_format.type", "grammar"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    (
        "chat",
        {"response_format": {"type": "text", "schema": FILM}},
        "response_format",
        "no schema",
    ),
    ("chat", {"structured_outputs": {"json": FILM, "x": 1}}, "structured_outputs.x", "permitted"),
    (
        "chat",
        {
            "structured_outputs": {
                "json": FILM,
                "open_objects": True,
                "disable_additional_properties": True,
            }
        },
        "structured_outputs",
        "open_objects and disable_additional_properties",
    ),
    ("chat", {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ("chat", {"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "custom"),
    ("chat", {"tools": [tool_with({}, name="has space")]}, "tools", "function name"),
    (
        "chat",
        {"tools": [tool_with({"type": "object", "properties": {"a": {"type": "nope"}}})]},
        "tools",
        "tools[0].function.parameters is invalid",
    ),
    ("chat", {"tools": [tool_with({"type": "string"})]}, "tools", "object"),
    (
        "chat",
        {
            "tools": [tool_with({"type": "object", "properties": {"a": {"uniqueItems": True}}})],
            "tool_choice": "required",
        },
        "tools",
        "uniqueItems",
    ),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": "required", "guided_decoding_backend": "outlines"},
        "tools",
        "xgrammar",
    ),
    ("chat", {"tools": [TOOL, TOOL]}, "tools", "duplicate"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/no"}}}},
        "response_format",
        "resolves to nothing",
    ),
    ("chat", {"tools": [tool_with({"$ref": "#/$defs/x"})]}, "tools", "resolves to nothing"),
    ("completions", {"guided_json": {"$ref": "#/nope"}}, "guided_json", "resolves to nothing"),
    # Specs that pass the checks at submission but that no backend can compile: the
    # compile's own error, as a 400 (not a 500: retrying would not help).
    (
        "chat",
        {
            "response_format": {
                "type": "json_object",
                "schema": {"type": "integer", "minimum": 5, "maximum": 2},
            }
        },
        "response_format",
        "minimum greater than maximum",
    ),
    (
        "completions",
        {"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}},
        "guided_json",
        "minLength 5 is greater than maxLength 2",
    ),
    (
        "completions",
        {"guided_json": FALSE_PROPERTY, "guided_decoding_backend": "xgrammar"},
        "guided_json",
        "cannot accept any value",
    ),
    ("completions", {"echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
    ("chat", {"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ("completions", {"suffix": "x"}, "suffix", "suffix"),
    ("completions", {"best_of": 3}, "best_of", "best_of"),
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("chat", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream"),
    ("completions", {"length_penalty": 0.5}, "length_penalty", "length_penalty"),
    ("completions", {"bad_words": ["x"]}, "bad_words", "bad_words"),
    ("completions", {"tools": [TOOL]}, "tools", "unknown field"),
    (
        "completions",
        {"guided_decoding_backend": "lm-format-enforcer"},
        "guided_decoding_backend",
        "lm-format-enforcer",
    ),
    (
        "completions",
        {"guided_regex": "a", "guided_decoding_backend": "xgrammar:frob"},
        "guided_decoding_backend",
        "frob",
    ),
    (
        "completions",
        {"guided_json": FILM, "guided_whitespace_pattern": "[ ]+"},
        "guided_whitespace_pattern",
        "empty string",
    ),
    (
        "completions",
        {"guided_json": FILM, "guided_whitespace_pattern": "("},
        "guided_whitespace_pattern",
        "regex",
    ),
    (
        "completions",
        {"guided_json": FILM, "whitespace_pattern": "[ ]?", "guided_whitespace_pattern": " ?"},
        "whitespace_pattern",
        "different whitespace",
    ),
    ("completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "different"),
    (
        "completions",
        {"response_format": {"type": "json_object"}, "guided_json": FILM},
        "guided_json",
        "different",
    ),
    ("completions", {"guided_choice": []}, "guided_choice", "at least one"),
]


@pytest.mark.parametrize(
    ("endpoint", "fields", "param", "word"), REFUSED, ids=lambda v: str(v)[:40]
)
def test_refused_fields_are_a_400_naming_them(
    default_model_server: str, endpoint: str, fields: dict[str, Any], param: str, word: str
) -> None:
    base = CHAT if endpoint == "chat" else COMPLETION
    r = httpx.post(
        f"{default_model_server}{PATHS[endpoint]}",
        json={**base, "max_tokens": 1, **fields},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert word in error["message"], error


@pytest.mark.parametrize("endpoint", PATHS)
def test_a_spec_that_cannot_compile_is_a_400_when_streamed_too(
    default_model_server: str, endpoint: str
) -> None:
    base = CHAT if endpoint == "chat" else COMPLETION
    body = base | {"stream": True, "guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}
    r = httpx.post(f"{default_model_server}{PATHS[endpoint]}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_json" and "minimum greater than maximum" in error["message"]


def test_auto_falls_back_where_one_backend_cannot_compile(default_model_server: str) -> None:
    body = COMPLETION | {"guided_json": FALSE_PROPERTY, "max_tokens": 12}
    r = httpx.post(f"{default_model_server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (out,) = r.json()["choices"]
    if out["finish_reason"] == "stop":
        jsonschema.validate(json.loads(out["text"]), FALSE_PROPERTY)
    else:
        assert out["finish_reason"] == "length" and out["text"].startswith("{")


# uniqueItems: no backend enforces it.
UNIQUE_TAGS = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 5},
            "uniqueItems": True,
            "maxItems": 3,
        }
    },
    "required": ["tags"],
    "additionalProperties": False,
}


def test_strict_false_drops_only_what_no_backend_enforces(default_model_server: str) -> None:
    """json_schema.strict false: the schema's enforceable part holds, the answer names what
    was not enforced, and /metrics counts it; strict true (or absent) is today's clear 400."""

    def send(strict: bool | None) -> httpx.Response:
        fmt: dict[str, Any] = {"name": "tags", "schema": UNIQUE_TAGS}
        if strict is not None:
            fmt["strict"] = strict
        body = CHAT | {"response_format": {"type": "json_schema", "json_schema": fmt}}
        return httpx.post(f"{default_model_server}/v1/chat/completions", json=body, timeout=120)

    for strict in (True, None):
        refused = send(strict)
        assert refused.status_code == 400 and "uniqueItems" in refused.text, strict
    before = httpx.get(f"{default_model_server}/metrics", timeout=30).text
    reply = send(False)
    assert reply.status_code == 200, reply.text
    assert "uniqueItems" in reply.json()["structured_outputs_unenforced"]
    (choice,) = reply.json()["choices"]
    if choice["finish_reason"] == "stop":
        lenient = {**UNIQUE_TAGS, "properties": {"tags": {**UNIQUE_TAGS["properties"]["tags"]}}}
        del lenient["properties"]["tags"]["uniqueItems"]
        jsonschema.validate(json.loads(choice["message"]["content"]), lenient)
    after = httpx.get(f"{default_model_server}/metrics", timeout=30).text
    name = "baton_structured_unenforced_requests_total"
    count = lambda text: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    assert count(after) == count(before) + 1


@pytest.mark.parametrize("endpoint", PATHS)
def test_fields_that_change_nothing_are_accepted(default_model_server: str, endpoint: str) -> None:
    harmless = {
        "user": "u-1",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        # Refused fields at their neutral values ask for nothing.
        "use_beam_search": False,
        "length_penalty": 1.0,
        "echo": False,
        "guided_json": None,
    }
    if endpoint == "chat":
        harmless |= {
            "modalities": ["text"],
            "functions": None,
            "parallel_tool_calls": True,
            "verbosity": "medium",  # OpenAI's default (the Agents SDK passes it on)
        }
    else:
        harmless |= {"suffix": None, "best_of": 1}
    base = CHAT if endpoint == "chat" else COMPLETION
    r = httpx.post(
        f"{default_model_server}{PATHS[endpoint]}",
        json={**base, "max_tokens": 1, **harmless},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_continue_final_message_continues_the_assistant_answer(default_model_server: str) -> None:
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    body = {
        "model": CHAT["model"],
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    r = httpx.post(f"{default_model_server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    continued = r.json()["choices"][0]["message"]["content"]
    # The same as completing the rendered text cut after the answer's start.
    tokenizer = load_tokenizer(None)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    ids = tokenizer.encode(text[: text.rindex("is") + 2], add_special_tokens=False)
    plain = COMPLETION | {"prompt": ids, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{default_model_server}/v1/completions", json=plain, timeout=60)
    assert r.status_code == 200, r.text
    assert continued == r.json()["choices"][0]["text"]


def test_vllm_structured_outputs_options() -> None:
    def spec(**field: Any) -> Any:
        body = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": field})
        constraint = request_constraint(body, "auto")
        assert constraint is not None and constraint.param == "structured_outputs"
        return constraint.spec

    assert spec(regex="a", disable_any_whitespace=False).whitespace == "any"
    assert spec(regex="a", disable_any_whitespace=True).whitespace == "compact"
    assert spec(regex="a", disable_fallback=True).backend == "xgrammar"
    assert spec(regex="a", disable_fallback=True, backend="outlines").backend == "outlines"
    assert spec(regex="a", whitespace="any", whitespace_pattern="[ ]*").whitespace == "compact"
    with pytest.raises(APIError, match="must admit the empty string") as info:
        spec(regex="a", whitespace_pattern="[ ]+")
    assert info.value.param == "structured_outputs.whitespace_pattern"
