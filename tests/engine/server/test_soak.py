"""Reliability of ``baton serve``: a short soak (mixed, invalid and abandoned requests), draining
on SIGTERM, and what clients see when the engine dies (errors and 503s, never a hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import serve_in_thread

from baton.bench.serving.server_process import ServerProcess, parse_metrics
from baton.bench.serving.soak import descendants, read_tree_rss_kb, run_soak
from baton.bench.serving.soak_requests import (
    INVALID_SPECS,
    SoakConfig,
    plan_requests,
    verify_output,
)
from baton.engine.entrypoints.async_llm import AsyncLLM
from baton.engine.executor.base import ExecutorError
from baton.engine.server.app import build_app
from baton.engine.server.config import ServerConfig


# ------------------------------------------------------------------ units
def test_plan_mixes_every_kind_in_exact_shares() -> None:
    config = SoakConfig(requests=100, invalid_fraction=0.1, disconnect_fraction=0.2)
    plan = plan_requests(config)
    kinds = [r.kind for r in plan]
    assert kinds.count("invalid") == 10 and kinds.count("disconnect") == 20
    assert {kinds.count(k) for k in ("text", "json", "regex", "choice")} == {17, 18}
    assert [r.body for r in plan] == [r.body for r in plan_requests(config)]  # deterministic
    assert all(r.stream and r.disconnect_after >= 1 for r in plan if r.kind == "disconnect")
    assert {r.path for r in plan} == {"/v1/chat/completions", "/v1/completions"}
    assert any(r.stream for r in plan if r.kind == "json")
    assert any(not r.stream for r in plan if r.kind == "json")
    invalid = [r for r in plan if r.kind == "invalid"]
    constraints = {
        (r.path, json.dumps(r.body.get("response_format") or r.body["structured_outputs"]))
        for r in invalid
    }
    assert len(constraints) == len(INVALID_SPECS)  # every kind of mistake is sent
    with pytest.raises(ValueError, match="concurrency"):
        SoakConfig(concurrency=0)
    with pytest.raises(ValueError, match="invalid_fraction"):
        SoakConfig(invalid_fraction=0.6, disconnect_fraction=0.6)


def test_verify_output_catches_each_kind_of_violation() -> None:
    plan = plan_requests(SoakConfig(requests=40))
    json_req = next(r for r in plan if r.kind == "json")
    regex_req = next(r for r in plan if r.kind == "regex")
    choice_req = next(r for r in plan if r.kind == "choice")
    good = '{"name":"a","age":3,"ok":true,"color":"red"}'
    assert verify_output(json_req, good) is None
    assert verify_output(json_req, good.replace('"a"', '"a\x18"')) is not None  # raw control char
    assert verify_output(json_req, good.replace("red", "pink")) is not None
    assert verify_output(regex_req, "12345-abc") is not None
    assert verify_output(choice_req, "red") is None
    assert verify_output(choice_req, "purple") is not None


def test_tree_rss_counts_the_worker_processes() -> None:
    """With async scheduling the model lives in a worker process: its memory must count."""
    child = subprocess.Popen(
        [sys.executable, "-c", "b = bytearray(64 << 20); import time; time.sleep(60)"]
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            own, workers = read_tree_rss_kb(os.getpid()) or (0, 0)
            if workers >= 64 << 10 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert own > 0 and workers >= 64 << 10, (own, workers)
        assert child.pid in descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert child.pid not in descendants(os.getpid())
    assert read_tree_rss_kb(child.pid) is None  # gone


# ------------------------------------------------------------------- soak
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_short_soak_meets_every_criterion(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = SoakConfig(
        requests=60,
        concurrency=8,
        max_tokens=16,
        model=str(tiny_model_dir),
        check_rss=False,  # too short a run for a steady state
        request_timeout_s=60.0,
        time_limit_s=90.0,
        startup_timeout_s=60.0,
    )
    result = run_soak(config, tmp_path / "serve.log")
    f = result["figures"]
    report = json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1)
    assert result["passed"], report
    assert set(result["criteria"]) >= {
        "every_valid_request_completed",
        "every_invalid_request_got_400",
        "no_5xx",
        "all_kv_blocks_free",
        "health_ok_after",
        "sigterm_exit_0",
    }
    assert f["requests_sent"] == 60 and f["invalid_400"] == 6 and f["disconnect"] == 6
    assert f["structured_stopped_checked"] > 0, report  # outputs really were verified
    assert f["server_requests_total"]["rejected"] == 6
    assert f["server_requests_total"]["aborted"] >= 1  # the hung-up streams were aborted
    assert f["rss_last_quarter_mb"] is not None and f["rss_growth"] is not None
    assert f["dtype"] in ("float32", "bfloat16")  # what the server reported computing in


# ---------------------------------------------------------------- SIGTERM
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigterm_drains_the_requests_in_flight_then_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokens = 120
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True}
    # The streamed request runs long enough that the plain one starts beside it even on a
    # loaded machine (with 120 tokens it once ended before the other arrived).
    streamed_tokens = 600
    streamed = {
        **body,
        "max_tokens": streamed_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    log = tmp_path / "serve.log"
    plain: dict[str, httpx.Response] = {}
    with ServerProcess(
        str(tiny_model_dir), server_args=["--shutdown-timeout", "60"], log_path=log
    ) as server:
        server.wait_healthy(60)
        url = f"{server.base}/v1/completions"
        sender = threading.Thread(
            target=lambda: plain.update(r=httpx.post(url, json=body, timeout=60))
        )
        events: list[str] = []
        with httpx.stream("POST", url, json=streamed, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    sender.start()
                    _wait_running(server.base, 2)
                    server.proc.send_signal(signal.SIGTERM)  # both requests are in flight
        sender.join(60)
        ended = time.monotonic()
        code = server.proc.wait(30)
        waited = time.monotonic() - ended
        tail = server.log_tail()
    assert events[-1] == "[DONE]", tail
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), tail
    assert chunks[-1]["usage"]["completion_tokens"] == streamed_tokens  # not cut off
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert plain["r"].status_code == 200, tail
    assert plain["r"].json()["usage"]["completion_tokens"] == tokens
    assert code == 0, tail
    assert waited < 10, f"exited {waited:.1f} s after the last request ended"


# ------------------------------------------------------------ engine death
def serve_engine(engine: AsyncLLM) -> AbstractContextManager[str]:
    """A uvicorn server for ``engine`` on a free loopback port; yields its base URL."""
    return serve_in_thread(build_app(engine, ServerConfig(served_model_name="tiny")))


def _fail_executor(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor reports the model gone (what a dead worker process looks like)."""

    def boom(*args: Any, **kwargs: Any) -> None:
        raise ExecutorError("injected: the model worker died")

    monkeypatch.setattr(engine._engine.core.executor, "execute_model", boom)


def _crash_engine_thread(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the engine loop: an unexpected exception escapes a step."""

    def boom() -> None:
        raise RuntimeError("injected engine bug")

    monkeypatch.setattr(engine._engine, "step", boom)


def _kill_worker(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model worker process is killed (e.g. by the OOM killer)."""
    executor = engine._engine.core.executor
    os.kill(executor.worker_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while executor.failure() is None and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("executor", "kill"),
    [
        ("uni", _fail_executor),
        ("uni", _crash_engine_thread),
        ("mp", _kill_worker),
    ],
    ids=["executor-error", "engine-thread-crash", "worker-killed"],
)
def test_engine_death_fails_requests_and_answers_503(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    executor: str,
    kill: Callable[[AsyncLLM, pytest.MonkeyPatch], None],
) -> None:
    engine = AsyncLLM.from_engine_args(
        str(tiny_model_dir), executor=executor, num_kv_blocks=128, max_model_len=2048
    )
    try:
        with serve_engine(engine) as base:
            long = {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True}
            plain: dict[str, httpx.Response] = {}
            sender = threading.Thread(
                target=lambda: plain.update(
                    r=httpx.post(f"{base}/v1/completions", json=long, timeout=30)
                )
            )
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=30
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                events: list[str] = []
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 2:
                            break
                sender.start()
                _wait_running(base, 2)
                kill(engine, monkeypatch)
                events += [line for line in lines if line.startswith("data: ")]
            sender.join(30)
            assert not sender.is_alive(), "the non-streamed request hung"
            # In flight: the stream ends with an error event, the plain request with a 5xx.
            assert events[-1] == "data: [DONE]"
            assert "error" in json.loads(events[-2][len("data: ") :])
            assert plain["r"].status_code in (500, 503)
            assert plain["r"].json()["error"]["type"] == "server_error"
            # New requests get 503 at once, /health fails, /metrics says so.
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            assert httpx.get(f"{base}/health", timeout=10).status_code == 503
            text = httpx.get(f"{base}/metrics", timeout=10).text
            assert parse_metrics(text)["baton_healthy"] == 0
    finally:
        engine.shutdown()
    assert not engine.is_healthy()


def _wait_running(base: str, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (
        parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text).get(
            "baton_num_requests_running", 0
        )
        < n
    ):
        assert time.monotonic() < deadline, f"{n} requests never ran together"
        time.sleep(0.02)
