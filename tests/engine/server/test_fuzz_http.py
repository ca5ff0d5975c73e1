"""Property-based fuzzing of the OpenAI-compatible HTTP API against a real server (tiny model):
random bodies built from the real parameter set with random types and values, unknown fields,
raw bytes (non-UTF-8, truncated, deeply nested, huge numbers) and oversized bodies. Whatever
comes in, the answer is never a 5xx, never hangs, and /health stays OK."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import serve_in_thread

from baton.engine.entrypoints.async_llm import AsyncLLM
from baton.engine.server.app import build_app
from baton.engine.server.config import ServerConfig

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
MODEL = "tiny"
MAX_BODY = 32 * 1024
# A hang is a request that takes longer than this (generation is capped by max_model_len).
REQUEST_TIMEOUT_S = 30.0
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class Server:
    base: str
    engine: AsyncLLM


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    # max_model_len and max_n bound the work any accepted request can ask for.
    engine = AsyncLLM.from_engine_args(
        str(tiny_model_dir),
        num_kv_blocks=128,
        max_num_seqs=8,
        max_model_len=96,
        grammar_compile_timeout_s=5.0,
    )
    config = ServerConfig(
        served_model_name=MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY, max_n=4
    )
    try:
        with serve_in_thread(build_app(engine, config), log_level="critical") as base:
            yield Server(base, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


# ------------------------------------------------------------------ strategies
# A body is mostly well-formed (so that it reaches sampling-parameter checks, grammar
# compilation and generation), with a few fields replaced by values of any type or range.

FLOATS = st.floats(allow_nan=True, allow_infinity=True)
INTS = st.one_of(
    st.integers(-3, 8),
    st.sampled_from([0, -1, 2**31, 2**63, -(2**63), 10**30]),
    st.integers(-(2**70), 2**70),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=12))
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
# Lone surrogates survive JSON (as \ud800 escapes) and reach the tokenizer as str.
TEXT = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(st.characters(categories=["Cs", "Cc", "Co", "Zs"]), min_size=1, max_size=8),
    st.sampled_from(["Hi", "<|im_start|>user", "{{ raise_exception('x') }}", "\x00", ""]),
)
TOKEN_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
BAD_TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), INTS), max_size=8)


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


SCHEMAS = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.just({"type": "string", "pattern": "(a+)+$"}),
    st.just({"type": "string", "maxLength": 100000}),
    st.just({"enum": ["x", "y"]}),
    st.just({"enum": list(range(3000))}),
    st.just(_deep_schema(300)),
    st.fixed_dictionaries({"type": st.sampled_from(["object", "array", "string", "bogus"])}),
    JSON_VALUES,
)
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"json": SCHEMAS}),
    st.fixed_dictionaries(
        {"regex": st.one_of(st.sampled_from(["[a-z]{2,5}", "(a+)+$", "a{1000}{1000}"]), TEXT)}
    ),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=4)}),
    st.fixed_dictionaries({"grammar": st.one_of(st.just('root ::= "yes" | "no"'), TEXT)}),
    st.fixed_dictionaries({"json_object": st.booleans()}),
    st.fixed_dictionaries(
        {"regex": st.just("[0-9]{2}")},
        optional={
            "backend": st.one_of(st.sampled_from(["auto", "xgrammar", "outlines"]), TEXT),
            "whitespace": st.sampled_from(["compact", "any", "none"]),
            "max_whitespace_cnt": st.integers(-1, 100),
            "json": SCHEMAS,
        },
    ),
)
RESPONSE_FORMAT = st.one_of(
    st.just({"type": "json_object"}),
    st.just({"type": "text"}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMAS}),
        }
    ),
    st.just({"type": "json_schema"}),
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), TEXT),
        "content": st.one_of(
            TEXT,
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "text", "image_url"]), "text": TEXT}
                ),
                max_size=3,
            ),
        ),
    },
    optional={"name": TEXT},
)
MESSAGES = st.one_of(
    st.just([{"role": "user", "content": "Hi there"}]),
    st.lists(MESSAGE, min_size=1, max_size=3),
)
PROMPT = st.one_of(
    TEXT,
    st.lists(TEXT, min_size=1, max_size=3),
    TOKEN_IDS,
    st.lists(TOKEN_IDS, min_size=1, max_size=2),
)
# The real parameter set of both endpoints, with in-range and boundary values.
COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, MODEL, "other"]),
    "n": st.integers(1, 5),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "max_tokens": st.one_of(st.integers(1, 24), st.sampled_from([0, 96, 10**6])),
    "min_tokens": st.integers(0, 4),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "seed": st.integers(0, 2**63 - 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 10),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT,
    "structured_outputs": STRUCTURED,
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(0, 49151).map(str), st.integers(-2, 10**20).map(str)),
        st.one_of(st.floats(-100, 100), st.integers(-101, 101)),
        max_size=3,
    ),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": MESSAGES,
    "max_completion_tokens": st.integers(1, 24),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 25),
    "response_format": RESPONSE_FORMAT,
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["tokenize", "add_generation_prompt", "messages", "x"]),
        JSON_VALUES,
        max_size=2,
    ),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": PROMPT,
    "logprobs": st.integers(0, 25),
}
INPUT_ITEM = st.one_of(
    MESSAGE,
    st.fixed_dictionaries(
        {"type": st.just("message"), "role": st.sampled_from(["user", "developer"])},
        optional={
            "content": st.one_of(
                TEXT,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["input_text", "input_image"]), "text": TEXT}
                    ),
                    max_size=2,
                ),
            )
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={"call_id": TEXT, "name": TEXT, "arguments": st.one_of(TEXT, JSON_VALUES)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output")},
        optional={"call_id": TEXT, "output": st.one_of(TEXT, JSON_VALUES)},
    ),
    st.fixed_dictionaries({"type": st.one_of(st.just("reasoning"), TEXT)}),
)
TEXT_FORMAT = st.one_of(
    st.just({"type": "text"}),
    st.just({"type": "json_object"}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema"), "name": st.just("x"), "schema": SCHEMAS},
        optional={"strict": st.booleans()},
    ),
    st.fixed_dictionaries({"type": st.one_of(st.just("json_schema"), TEXT)}),
)
FUNCTION_TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "web_search"])},
    optional={"name": TEXT, "parameters": SCHEMAS, "strict": st.booleans()},
)
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": COMMON_FIELDS["model"],
    "input": st.one_of(TEXT, st.lists(INPUT_ITEM, max_size=3)),
    "instructions": TEXT,
    "max_output_tokens": COMMON_FIELDS["max_tokens"],
    "temperature": COMMON_FIELDS["temperature"],
    "top_p": COMMON_FIELDS["top_p"],
    "seed": COMMON_FIELDS["seed"],
    "text": st.fixed_dictionaries({}, optional={"format": TEXT_FORMAT, "verbosity": TEXT}),
    "tools": st.lists(FUNCTION_TOOL, max_size=2),
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required"]),
        st.fixed_dictionaries({"type": st.just("function"), "name": TEXT}),
    ),
    "parallel_tool_calls": st.booleans(),
    "reasoning": st.fixed_dictionaries(
        {}, optional={"effort": st.sampled_from([None, "none", "low"]), "summary": TEXT}
    ),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": TEXT,
    "metadata": st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2),
    "user": TEXT,
}
# Real fields the server refuses (400) rather than silently ignore, or checks closely (tools,
# vLLM's guided_* spellings): rare, as mutations, so that most bodies get as far as generation.
REFUSED_FIELDS = (
    "logit_bias",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "echo",
    "suffix",
    "best_of",
    "functions",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "whitespace_pattern",
    "use_beam_search",
)
# Values of any type or range for a field: wrong types, negatives, huge, NaN.
BAD_VALUES = st.one_of(
    JSON_VALUES, INTS, FLOATS, BAD_TOKEN_IDS, st.lists(JSON_VALUES, max_size=3), st.just([])
)


def bodies(
    fields: dict[str, st.SearchStrategy[Any]], required: str, limit: str = "max_tokens"
) -> st.SearchStrategy[Any]:
    """Well-formed bodies (``required`` and a random subset of the other fields), with up to
    two fields (known or unknown, ``required`` included) set to any value; now and then a
    body that is not an object at all. ``limit``: the field that caps the output tokens."""
    names = sorted(fields)
    optional = {k: v for k, v in fields.items() if k not in (required, limit)}
    # Short generations mostly; max_model_len bounds the longest.
    max_tokens = st.one_of(st.integers(1, 8), fields[limit])
    base = st.fixed_dictionaries({required: fields[required], limit: max_tokens}, optional=optional)
    mutations = st.dictionaries(
        st.one_of(
            st.sampled_from(names),
            st.sampled_from(REFUSED_FIELDS),
            st.text(min_size=1, max_size=10),
        ),
        BAD_VALUES,
        max_size=2,
    )
    dropped = st.lists(st.sampled_from(names), max_size=1)
    well_formed = st.builds(
        lambda body, bad, drop: {k: v for k, v in {**body, **bad}.items() if k not in drop},
        base,
        st.one_of(st.just({}), mutations),
        st.one_of(st.just([]), dropped),
    )
    return st.one_of(*[well_formed] * 7, JSON_VALUES)


def _nested(depth: int, open_: str, close: str) -> bytes:
    return (open_ * depth + close * depth).encode()


RAW_BODIES = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"\xff\xfe\xfa\x00\x80",
            b'{"prompt": "\xff\xfe", "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
            b'{"prompt": "hi", "max_tokens": ',
            b'{"prompt": "hi", "max_tokens": 1e999999}',
            b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
            b'{"prompt": "hi", "temperature": NaN, "max_tokens": 2}',
            b'{"prompt": "hi", "temperature": -Infinity, "max_tokens": 2}',
            b'{"prompt": "hi", "prompt": [1, 2], "max_tokens": 2}',
            b"null",
            b"[]",
            b'"just a string"',
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            _nested(100_000, "[", "]"),
            _nested(20_000, '{"a":', "}")[:-1] + b"1" + b"}" * 20_000,
            b'{"prompt": ' + _nested(5000, "[", "]") + b"}",
            b'{"structured_outputs": {"json": ' + _nested(3000, "[", "]") + b'}, "prompt": "x"}',
        ]
    ),
    st.text(max_size=100).map(lambda s: s.encode("utf-16")),
)


def check_alive(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text


def post(client: httpx.Client, path: str, content: bytes, content_type: str) -> httpx.Response:
    headers = {**HEADERS, "Content-Type": content_type}
    # Reads the whole body (a stream included) within the timeout: a hang raises.
    return client.post(path, content=content, headers=headers)


def assert_not_5xx(r: httpx.Response, sent: bytes) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500], sent[:300])
    if r.status_code >= 400:
        body = r.json()
        assert isinstance(body.get("error", {}).get("message"), str), r.text[:300]


def wait_idle(server: Server, timeout_s: float = 20.0) -> None:
    """Every request that the fuzz started has ended and released its KV blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.engine.stats()
        if (
            stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and stats["kv_free_blocks"] == stats["kv_total_blocks"]
        ):
            break
        assert time.monotonic() < deadline, f"requests left behind: {stats}"
        time.sleep(0.05)


FUZZ_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ENDPOINTS)
def test_random_json_bodies_never_get_a_5xx(
    server: Server, client: httpx.Client, path: str
) -> None:
    fields, required, limit = {
        "/v1/chat/completions": (CHAT_FIELDS, "messages", "max_tokens"),
        "/v1/completions": (COMPLETION_FIELDS, "prompt", "max_tokens"),
        "/v1/responses": (RESPONSES_FIELDS, "input", "max_output_tokens"),
    }[path]

    @FUZZ_SETTINGS
    @given(body=bodies(fields, required, limit))
    def fuzz(body: Any) -> None:
        content = json.dumps(body).encode()  # NaN and Infinity included, as Python writes them
        r = post(client, path, content, "application/json")
        assert_not_5xx(r, content)
        check_alive(client)

    fuzz()
    wait_idle(server)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ENDPOINTS)
def test_raw_and_oversized_bodies_never_get_a_5xx(
    server: Server, client: httpx.Client, path: str
) -> None:
    @settings(FUZZ_SETTINGS, max_examples=50)
    @given(
        content=RAW_BODIES,
        content_type=st.sampled_from(
            ["application/json", "text/plain", "application/x-www-form-urlencoded"]
        ),
    )
    def fuzz(content: bytes, content_type: str) -> None:
        if len(content) > MAX_BODY:
            try:
                r = post(client, path, content, content_type)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                # The server answers 413 and closes without reading the rest of the body;
                # a client still sending may see the reset before the answer (racy).
                check_alive(client)
                return
            assert r.status_code == 413, (r.status_code, r.text[:300])
        else:
            r = post(client, path, content, content_type)
        assert_not_5xx(r, content)
        check_alive(client)

    fuzz()
    wait_idle(server)


def _raw_post(server: Server, declared: int, body: bytes) -> bytes:
    """Sends a POST declaring ``declared`` body bytes but only ``body``; the answer's start."""
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        return sock.recv(4096)


@pytest.mark.timeout(60)
def test_oversized_and_unauthenticated_bodies_are_refused(
    server: Server, client: httpx.Client
) -> None:
    # Declared over the limit: refused before the body is read, so no client waits for it.
    assert _raw_post(server, 10**9, b'{"prompt": "').startswith(b"HTTP/1.1 413")
    assert _raw_post(server, MAX_BODY + 1, b"").startswith(b"HTTP/1.1 413")
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401
    ok = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=HEADERS
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    check_alive(client)
