"""The OpenAI-compatible server, driven by the official ``openai`` client (and raw httpx where
the wire format itself is checked) against a real uvicorn server on a loopback port."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import serve_in_thread
from pydantic import BaseModel, Field

from baton.engine.entrypoints.async_llm import AsyncLLM
from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.engine.server.app import build_app
from baton.engine.server.config import ServerConfig
from baton.engine.server.errors import APIError
from baton.engine.server.metrics import ServerMetrics
from baton.engine.server.params import chat_sampling_params, completion_sampling_params
from baton.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from baton.engine.server.serve import add_serve_parser, default_served_model_name

API_KEY = "test-key"
MODEL = "tiny"
MAX_BODY = 64 * 1024

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@dataclass(frozen=True)
class Server:
    base: str
    engine: AsyncLLM

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(api_key=api_key, base_url=f"{self.base}/v1", max_retries=0)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


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


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (``labels`` as written, e.g. 'status="x"')."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample == key:
            return float(value)
    raise AssertionError(f"no sample {key} in /metrics")


def get_metrics(server: Server) -> str:
    r = httpx.get(f"{server.base}/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


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


# ------------------------------------------------------------ busy compiles
# outlines builds this pattern's DFA for hours (it doubles with each repetition).
HOSTILE_PATTERN = "^(a|b)*a(a|b){%d}$"


@pytest.mark.timeout(240)
def test_a_full_compile_queue_answers_503_with_retry_after(tiny_model_dir: Path) -> None:
    # One compile runs and one may wait: two hostile specs fill both places, a third spec
    # is refused with 503 and Retry-After, and the same request succeeds after that wait.
    engine = AsyncLLM.from_engine_args(
        str(tiny_model_dir),
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=512,
        # Long enough that the busy request surely arrives while the first compile runs.
        grammar_compile_timeout_s=3.0,
        grammar_compile_workers=1,
        grammar_compile_max_workers=1,
        grammar_compile_queue_size=1,
    )
    config = ServerConfig(served_model_name=MODEL, structured_outputs_backend="outlines")
    try:
        with serve_in_thread(build_app(engine, config)) as base:

            def complete(constraint: dict[str, object]) -> httpx.Response:
                body = {
                    "model": MODEL,
                    "prompt": "Code:",
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "structured_outputs": constraint,
                }
                return httpx.post(f"{base}/v1/completions", json=body, timeout=120)

            def hostile(n: int) -> httpx.Response:
                return complete({"json": {"type": "string", "pattern": HOSTILE_PATTERN % n}})

            code = {"regex": "[0-9]{3}-[a-z]{2}"}
            # The worker template process starts on the first compile: not in the timing.
            assert complete({"regex": "[0-9]{2}"}).status_code == 200

            def wait_for(name: str, value: int) -> None:
                deadline = time.monotonic() + 60
                while engine.stats().get(name) != value:
                    assert time.monotonic() < deadline, f"{name} never reached {value}"
                    time.sleep(0.02)

            with ThreadPoolExecutor(2) as pool:
                # One after the other: sent together, the second could find the first still
                # in the queue (not yet picked up by the dispatcher) and be refused itself.
                hostile_calls = [pool.submit(hostile, 20)]
                wait_for("grammar_compile_running", 1)
                hostile_calls.append(pool.submit(hostile, 21))
                wait_for("grammar_compile_queue_length", 1)
                time.sleep(0.6)  # the running compile's pace is known by now
                busy = complete(code)
                assert busy.status_code == 503, busy.text
                assert busy.json()["error"]["code"] == "busy"
                retry_after = int(busy.headers["Retry-After"])
                # The first compile ends within its 3 s limit at any pace above a quarter core.
                assert 1 <= retry_after <= 15
                time.sleep(retry_after)
                ok = complete(code)
                assert ok.status_code == 200, ok.text
                assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", ok.json()["choices"][0]["text"])
                for call in hostile_calls:
                    # Past its time limit a compile fails because of its spec: a 400.
                    assert call.result().status_code == 400, call.result().text
            text = get_metrics(Server(base, engine))
            assert metric(text, "baton_grammar_compile_rejected_total") == 1
            # The 503 and the two hostile specs' 400s.
            assert metric(text, "baton_requests_total", 'status="rejected"') == 3
            assert metric(text, "baton_grammar_compile_timeouts_total") == 2
            assert metric(text, "baton_grammar_compile_worker_kills_total") == 2
    finally:
        engine.shutdown()


# ------------------------------------------------- units (no server needed)


def test_params_from_request_bodies() -> None:
    config = ServerConfig(served_model_name=MODEL, structured_outputs_backend="outlines")
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": MESSAGES,
            "max_tokens": 50,
            "max_completion_tokens": 7,
            "stop": "END",
            "logprobs": True,
            "top_logprobs": 4,
            "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON_SCHEMA}},
        }
    )
    p, constraint = chat_sampling_params(chat, config)
    assert constraint is not None and constraint.param == "response_format"
    assert p.max_tokens == 7 and p.stop == ("END",) and p.logprobs == 4
    assert p.structured_outputs is not None
    assert p.structured_outputs.schema == PERSON_SCHEMA
    assert p.structured_outputs.backend == "outlines"  # the server's default backend
    both = chat.model_copy(
        update={
            "structured_outputs": CompletionRequest.model_validate(
                {"prompt": "x", "structured_outputs": {"regex": "a"}}
            ).structured_outputs
        }
    )
    with pytest.raises(APIError, match="ask for different constraints"):
        chat_sampling_params(both, config)
    with pytest.raises(APIError, match="top_logprobs needs logprobs"):
        chat_sampling_params(
            ChatCompletionRequest.model_validate({"messages": MESSAGES, "top_logprobs": 2}), config
        )
    comp = CompletionRequest.model_validate(
        {"prompt": [1, 2], "structured_outputs": {"choice": ["a", "b"], "backend": "xgrammar"}}
    )
    p, _ = completion_sampling_params(comp, config)
    assert p.max_tokens == 16 and p.structured_outputs.choice == ("a", "b")
    assert p.structured_outputs.backend == "xgrammar"
    with pytest.raises(APIError) as info:
        completion_sampling_params(
            CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {}}), config
        )
    assert info.value.status == 400 and "exactly one" in info.value.message
    # The model's sampling defaults fill what a request leaves out; the request's own win.
    defaults = {"temperature": 0.3, "top_p": 0.8}
    p, _ = completion_sampling_params(comp, config, defaults=defaults)
    assert p.temperature == pytest.approx(0.3) and p.top_p == pytest.approx(0.8)
    own = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.0})
    p, _ = completion_sampling_params(own, config, defaults=defaults)
    assert p.temperature == 0.0 and p.top_p == pytest.approx(0.8)
    p, _ = chat_sampling_params(
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "top_p": 0.5}),
        config,
        defaults=defaults,
    )
    assert p.temperature == pytest.approx(0.3) and p.top_p == pytest.approx(0.5)


def test_metrics_render() -> None:
    m = ServerMetrics()
    out = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, "ab", [5, 6], None, None, "stop")],
        finished=True,
        metrics=RequestMetrics(
            arrival_time=0.0, first_token_time=0.04, last_token_time=0.05, num_generation_tokens=2
        ),
    )
    m.observe_request("finished", out, structured=True)
    m.observe_request("aborted", None, structured=False)
    m.reject()
    stats = {
        "num_running": 2,
        "kv_usage": 0.25,
        "grammar_compile_queue_length": 4,
        "grammar_cache_bytes": 123456,
        "grammar_compile_timeouts": 1,
        "grammar_compile_seconds_count": 3,
        "grammar_compile_seconds_sum": 0.5,
        "grammar_compile_seconds_le_0.01": 1,
        "grammar_compile_seconds_le_0.5": 3,
        "dtype": "bfloat16",
        "quantization": "int8",
    }
    text = m.render(stats, healthy=True)
    info = next(line for line in text.splitlines() if line.startswith("baton_model_compute_info"))
    assert 'dtype="bfloat16"' in info and 'quantization="int8"' in info
    assert text.endswith("\n")
    assert metric(text, "baton_requests_total", 'status="finished"') == 1
    assert metric(text, "baton_requests_total", 'status="aborted"') == 1
    assert metric(text, "baton_requests_total", 'status="rejected"') == 1
    assert metric(text, "baton_requests_total", 'status="error"') == 0
    assert metric(text, "baton_prompt_tokens_total") == 3
    assert metric(text, "baton_generation_tokens_total") == 2
    assert metric(text, "baton_structured_fraction") == 0.5
    assert metric(text, "baton_time_to_first_token_seconds_bucket", 'le="0.05"') == 1
    assert metric(text, "baton_time_to_first_token_seconds_bucket", 'le="0.02"') == 0
    assert metric(text, "baton_time_to_first_token_seconds_count") == 1
    assert metric(text, "baton_time_per_output_token_seconds_count") == 1
    assert metric(text, "baton_num_requests_running") == 2
    assert metric(text, "baton_kv_cache_usage") == 0.25
    assert metric(text, "baton_grammar_compile_seconds_count") == 3
    assert metric(text, "baton_grammar_compile_seconds_bucket", 'le="0.01"') == 1
    assert metric(text, "baton_grammar_compile_seconds_bucket", 'le="0.25"') == 0
    assert metric(text, "baton_grammar_compile_seconds_bucket", 'le="0.5"') == 3
    assert metric(text, "baton_grammar_compile_seconds_bucket", 'le="+Inf"') == 3
    assert metric(text, "baton_grammar_compile_queue_length") == 4
    assert metric(text, "baton_grammar_cache_bytes") == 123456
    assert metric(text, "baton_grammar_compile_timeouts_total") == 1
    assert metric(text, "baton_grammar_compile_worker_kills_total") == 0
    assert metric(text, "baton_healthy") == 1
    with pytest.raises(ValueError, match="status must be one of"):
        m.observe_request("weird", None, structured=False)


def test_serve_parser_and_default_name(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "--port", "9000", "--structured-outputs-backend", "outlines"]
    )
    assert args.host == "127.0.0.1" and args.port == 9000 and args.api_key is None
    assert args.structured_outputs_backend == "outlines" and callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--structured-outputs-backend", "nope"])
    gguf = tmp_path / "My-Model.Q4_1.gguf"
    gguf.write_bytes(b"")
    assert default_served_model_name(str(gguf)) == "My-Model.Q4_1"
    assert default_served_model_name(str(tmp_path)) == tmp_path.name
    with pytest.raises(ValueError, match="served_model_name"):
        ServerConfig(served_model_name="")
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        ServerConfig(served_model_name="m", structured_outputs_backend="nope")


class _BrokenEngine:
    """Just enough of a ServingEngine for the app: unhealthy, and its tokenizer access fails."""

    max_model_len = 128

    def get_tokenizer(self) -> None:
        raise RuntimeError("tokenizer exploded")

    def stats(self) -> dict[str, float | int]:
        return {}

    def is_healthy(self) -> bool:
        return False

    def replica_stats(self) -> list[dict[str, float | int | str]]:
        return []


def test_unexpected_failure_is_500_and_unhealthy_is_503() -> None:
    from fastapi.testclient import TestClient

    app = build_app(_BrokenEngine(), ServerConfig(served_model_name=MODEL))  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        # The exception's text stays in the server log; the client gets a reference.
        message = r.json()["error"]["message"]
        assert "tokenizer exploded" not in message and re.search(r"ref [0-9a-f]{12}", message)
        r = client.get("/health")
        assert r.status_code == 503 and "error" in r.json()
        assert metric(client.get("/metrics").text, "baton_healthy") == 0
        # No API key configured: /v1 is open.
        assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
