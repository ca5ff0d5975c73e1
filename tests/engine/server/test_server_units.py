"""The OpenAI-compatible server: a full compile queue answers 503 (a server of its own), and its
pieces without a server (sampling params from request bodies, /metrics text, the serve parser,
an unexpected failure's 500 and an unhealthy engine's 503)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_testing import MESSAGES, MODEL, PERSON_SCHEMA, Server, get_metrics, metric
from serving import serve_in_thread

from baton.engine.entrypoints.async_llm import AsyncLLM
from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.engine.server.app import build_app
from baton.engine.server.config import ServerConfig
from baton.engine.server.errors import APIError
from baton.engine.server.metrics import ServerMetrics
from baton.engine.server.params import chat_sampling_params, completion_sampling_params
from baton.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from baton.engine.server.serve import add_serve_parser, default_served_model_name

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

    def model_architecture(self) -> str:
        return "llama"

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
