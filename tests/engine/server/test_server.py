"""The OpenAI-compatible server, driven by the official ``openai`` client (and raw httpx where
the wire format itself is checked) against a real uvicorn server on a loopback port: basics,
structured chat, completions, errors and disconnects."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_testing import API_KEY, MESSAGES, MODEL, PERSON_SCHEMA, Server, get_metrics, metric
from serving import serve_in_thread

from baton.engine.entrypoints.async_llm import AsyncLLM
from baton.engine.server.app import build_app
from baton.engine.server.config import ServerConfig

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    engine = AsyncLLM.from_engine_args(
        str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=8, max_model_len=2048
    )
    config = ServerConfig(served_model_name=MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY)
    try:
        with serve_in_thread(build_app(engine, config), log_level="warning") as base:
            yield Server(base, engine)
    finally:
        engine.shutdown()


def wait_idle_metrics(server: Server, aborted_before: float, timeout_s: float = 15.0) -> str:
    """/metrics once an abort was counted and the engine is idle with every KV block free."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = get_metrics(server)
        done = (
            metric(text, "baton_requests_total", 'status="aborted"') > aborted_before
            and metric(text, "baton_num_requests_running") == 0
            and metric(text, "baton_kv_free_blocks") == metric(text, "baton_kv_total_blocks")
        )
        if done or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


# ---------------------------------------------------------------- basics
@pytest.mark.timeout(60)
def test_models_health_and_metrics_format(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(f"{server.base}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(f"{server.base}/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in (
        "baton_requests_total",
        "baton_prompt_tokens_total",
        "baton_generation_tokens_total",
        "baton_time_to_first_token_seconds",
        "baton_time_per_output_token_seconds",
        "baton_num_requests_running",
        "baton_num_requests_waiting",
        "baton_kv_cache_usage",
        "baton_kv_free_blocks",
        "baton_grammar_compile_seconds",
        "baton_grammar_compile_queue_length",
        "baton_grammar_compile_timeouts_total",
        "baton_grammar_compile_worker_kills_total",
        "baton_grammar_cache_hits_total",
        "baton_grammar_cache_bytes",
        "baton_structured_fraction",
        "baton_device_busy_fraction",
        "baton_deferred_steps_total",
        "baton_spec_draft_tokens_total",
        "baton_spec_accepted_tokens_total",
    ):
        assert f"# TYPE {name} " in r.text, name
    assert metric(r.text, "baton_kv_total_blocks") == 255
    stats = server.engine.stats()
    info = next(
        line for line in r.text.splitlines() if line.startswith("baton_model_compute_info{")
    )
    assert f'dtype="{stats["dtype"]}"' in info and info.endswith(" 1")
    assert f'quantization="{stats["quantization"]}"' in info


# ------------------------------------------------------- structured chat
@pytest.mark.timeout(60)
def test_chat_json_schema(server: Server) -> None:
    before = get_metrics(server)
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
        max_tokens=200,
        temperature=0.0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    after = get_metrics(server)
    assert metric(after, "baton_structured_requests_total") == (
        metric(before, "baton_structured_requests_total") + 1
    )
    assert metric(after, "baton_generation_tokens_total") - metric(
        before, "baton_generation_tokens_total"
    ) == float(r.usage.completion_tokens)
    compiles = metric(after, "baton_grammar_compile_seconds_count") + metric(
        after, "baton_grammar_cache_hits_total"
    )
    assert compiles >= 1
    if server.engine.config.speculative_config is not None:  # the default drafts (sync here)
        # The schema forces `{"name":"` and more: the grammar drafter proposed those tokens.
        drafted = metric(after, "baton_spec_draft_tokens_total")
        assert drafted > metric(before, "baton_spec_draft_tokens_total")
        assert metric(after, "baton_spec_accepted_tokens_total") <= drafted


@pytest.mark.timeout(60)
def test_chat_json_schema_streamed(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        },
        max_tokens=200,
        temperature=1.0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(content), PERSON_SCHEMA)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens >= len(chunks) - 3


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


@pytest.mark.timeout(60)
def test_parse_helper_returns_a_model(server: Server) -> None:
    completions = server.client().chat.completions
    parse = getattr(completions, "parse", None) or server.client().beta.chat.completions.parse
    r = parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=100, seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Pet)
    assert parsed.kind in ("cat", "dog", "fish") and 0 <= parsed.age <= 30


@pytest.mark.timeout(60)
def test_chat_json_object_and_logprobs(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_completion_tokens=6,
        max_tokens=500,  # max_completion_tokens wins
        logprobs=True,
        top_logprobs=3,
        seed=1,
    )
    choice = r.choices[0]
    assert r.usage.completion_tokens <= 6
    assert choice.message.content.startswith("{")
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0.0
        tops = [t.logprob for t in e.top_logprobs]
        assert 1 <= len(tops) <= 3 and tops == sorted(tops, reverse=True)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token


# ---------------------------------------------------------- completions
@pytest.mark.timeout(60)
def test_completion_regex_and_choice(server: Server) -> None:
    client = server.client()
    pattern = r"[0-9]{3}-[a-z]{2}"
    r = client.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=30,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    choices = ["red", "green", "blue"]
    r = client.completions.create(
        model=MODEL,
        prompt="Color:",
        n=3,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text in choices for c in r.choices)


@pytest.mark.timeout(60)
def test_completion_token_prompts_and_n(server: Server) -> None:
    prompts = [[1, 504, 3300], [1, 30, 31, 32, 33]]
    r = server.client().completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=5, extra_body={"ignore_eos": True}, seed=5
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert r.usage.completion_tokens == 4 * 5
    texts = {c.text for c in r.choices}
    assert len(texts) > 1  # different seeds per completion, different prompts


@pytest.mark.timeout(60)
def test_seed_reproducible_over_http(server: Server) -> None:
    client = server.client()

    def text(seed: int) -> str:
        r = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    first = text(1234)
    assert text(1234) == first
    assert len({first, text(1), text(2)}) > 1


@pytest.mark.timeout(60)
def test_completion_stream_wire_format(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "seed": 11,
        "ignore_eos": True,
        "logprobs": 2,
    }
    whole = httpx.post(
        f"{server.base}/v1/completions", json=body, headers=server.headers(), timeout=30
    ).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST",
        f"{server.base}/v1/completions",
        json=streamed,
        headers=server.headers(),
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == whole["choices"][0]["text"]
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------- errors
@pytest.mark.timeout(60)
def test_invalid_schema_is_400_naming_the_problem(server: Server) -> None:
    client = server.client()
    bad_schema = {"type": "object", "properties": {"age": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": bad_schema},
            },
        )
    err = info.value.body
    assert info.value.status_code == 400
    assert "nonsense" in err["message"] and err["param"] == "response_format"
    assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "([a-z"}}
        )
    assert info.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert "temperature" in info.value.body["message"]
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n="many")  # type: ignore[arg-type]
    assert info.value.body["param"] == "n"
    # The server is still up and serving.
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


@pytest.mark.timeout(60)
def test_bad_or_missing_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    r = httpx.get(f"{server.base}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.base}/health").status_code == 200  # not behind the key


@pytest.mark.timeout(60)
def test_a_plain_model_served_without_flags_gets_no_parser(server: Server) -> None:
    # Only gpt-oss gets parsers nobody named (harmony's): this Llama-shaped model none.
    r = httpx.get(f"{server.base}/v1/models", headers=server.headers())
    (card,) = r.json()["data"]
    assert (card["reasoning_parser"], card["tool_call_parser"]) == (None, None)
    assert server.engine.stats()["reasoning_parser"] == "none"


@pytest.mark.timeout(60)
def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found" and "gpt-9" in info.value.body["message"]


@pytest.mark.timeout(60)
def test_oversized_body_is_413(server: Server) -> None:
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    url = f"{server.base}/v1/completions"
    r = httpx.post(url, json=big, headers=server.headers(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    r = httpx.post(url, content=chunks(), headers=server.headers(), timeout=30)
    assert r.status_code == 413
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert httpx.post(url, json=ok, headers=server.headers(), timeout=30).status_code == 200


@pytest.mark.timeout(60)
def test_stream_disconnect_aborts_and_frees_kv(server: Server) -> None:
    aborted = metric(get_metrics(server), "baton_requests_total", 'status="aborted"')
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{server.base}/v1/chat/completions", json=body, headers=server.headers()
        ) as r,
    ):
        assert r.status_code == 200
        seen = 0
        # Held, so that leaving the loop does not close it (and the connection) yet.
        lines = r.iter_lines()
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 4:
                break
        busy = get_metrics(server)
        assert metric(busy, "baton_num_requests_running") == 1
        assert metric(busy, "baton_kv_free_blocks") < metric(busy, "baton_kv_total_blocks")
    text = wait_idle_metrics(server, aborted)
    assert metric(text, "baton_requests_total", 'status="aborted"') == aborted + 1
    # Aborted, not run to its 1500 tokens: only the steps already in flight ran after.
    steps = metric(text, "baton_engine_steps_total") - metric(busy, "baton_engine_steps_total")
    assert steps < 300
    assert metric(busy, "baton_requests_total", 'status="aborted"') == aborted
    assert metric(text, "baton_num_requests_running") == 0
    assert metric(text, "baton_kv_free_blocks") == metric(text, "baton_kv_total_blocks")
    assert metric(text, "baton_kv_cache_usage") == 0


@pytest.mark.timeout(60)
def test_non_stream_disconnect_aborts(server: Server) -> None:
    before = get_metrics(server)
    aborted = metric(before, "baton_requests_total", 'status="aborted"')
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base}/v1/completions",
            json=body,
            headers=server.headers(),
            timeout=httpx.Timeout(10, read=0.5),
        )
    text = wait_idle_metrics(server, aborted)
    assert metric(text, "baton_requests_total", 'status="aborted"') == aborted + 1
    steps = metric(text, "baton_engine_steps_total") - metric(before, "baton_engine_steps_total")
    assert steps < 1000  # the 0.5 s before the disconnect, not all 1500 tokens
    assert metric(text, "baton_kv_free_blocks") == metric(text, "baton_kv_total_blocks")


@pytest.mark.timeout(60)
def test_no_prompt_text_reaches_the_logs(
    server: Server, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    # INFO is the default log level of baton serve; prompts must not show at it, on any path:
    # success, streaming, a bad request and a request that fails inside the engine.
    caplog.set_level(logging.INFO)
    secret = "zebra-quartz-7781"
    client = server.client()
    messages = [{"role": "user", "content": f"Say {secret}."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    stream = client.completions.create(model=MODEL, prompt=secret, max_tokens=4, stream=True)
    assert list(stream)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=secret, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL, prompt=secret, extra_body={"structured_outputs": {"regex": "([a-z"}}
        )
    # min_tokens past what the grammar allows used to fail inside the engine.
    client.completions.create(
        model=MODEL,
        prompt=secret,
        max_tokens=8,
        extra_body={"min_tokens": 3, "structured_outputs": {"choice": ["a"]}},
    )
    out, err = capfd.readouterr()
    assert secret not in caplog.text and secret not in out and secret not in err
