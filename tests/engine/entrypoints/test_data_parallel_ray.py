"""Data parallel on Ray, end to end: a local Ray cluster started here, two engine replicas
(``DataParallelLLM``) behind the OpenAI server, driven through the OpenAI client.

Checks: 64 concurrent mixed requests (text, JSON schema, regex, choice) all served and valid;
every request of one grammar lands on one replica (the affinity counters in /metrics, and only
one replica compiled grammars); a replica killed mid-run fails only requests it had started
streaming, the ones it had not are served by the survivor, Ray restarts it and /health shows it
back. Skipped where Ray is not installed."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from serving import serve_in_thread

ray = pytest.importorskip("ray")

from baton.engine.entrypoints.args import engine_config  # noqa: E402
from baton.engine.entrypoints.data_parallel import DataParallelLLM  # noqa: E402
from baton.engine.entrypoints.dp_config import DataParallelConfig  # noqa: E402
from baton.engine.server.app import build_app  # noqa: E402
from baton.engine.server.config import ServerConfig  # noqa: E402

MODEL = "tiny"
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 3,
    },
]
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
MAX_NUM_SEQS = 8
# Every schema is bounded, so that the random tiny model's outputs end within max_tokens.


@dataclass(frozen=True)
class Cluster:
    base: str
    engine: DataParallelLLM

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(api_key="none", base_url=f"{self.base}/v1", max_retries=0)

    def metrics(self) -> str:
        r = httpx.get(f"{self.base}/metrics", timeout=10)
        assert r.status_code == 200
        return r.text

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.base}/health", timeout=10)


def metric(text: str, name: str, labels: str = "") -> float:
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if not line.startswith("#") and sample == key:
            return float(value)
    raise AssertionError(f"no sample {key} in /metrics")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    ray.init(
        num_cpus=2,
        object_store_memory=128 << 20,
        include_dashboard=False,
        log_to_driver=False,
    )
    engine = None
    try:
        config = engine_config(
            str(tiny_model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=1024, num_kv_blocks=256
        )
        # Affinity always wins here (the busy fallback is the router's unit tests').
        dp = DataParallelConfig(size=2, cpus_per_replica=1, balance_tokens=10**9)
        engine = DataParallelLLM(config, dp)
        with serve_in_thread(build_app(engine, ServerConfig(served_model_name=MODEL))) as base:
            yield Cluster(base, engine)
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()


def test_a_model_that_cannot_be_read_fails_before_any_replica_starts(tmp_path: Path) -> None:
    from baton.engine.loader import ModelLoadError

    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        DataParallelLLM(engine_config(str(missing)), DataParallelConfig(size=2))


def _request(client: openai.OpenAI, i: int) -> tuple[str, str]:
    """Request ``i`` of the mix; returns (kind, output text) after checking the output."""
    kind = ("text", "json", "regex", "choice")[i % 4]
    if kind == "json":
        schema = SCHEMAS[(i // 4) % len(SCHEMAS)]
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Item {i} as JSON."}],
            max_tokens=48,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "item", "schema": schema},
            },
        )
        text = r.choices[0].message.content or ""
        assert r.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)
        return kind, text
    extra: dict[str, object] = {}
    if kind == "regex":
        extra = {"structured_outputs": {"regex": REGEX}}
    elif kind == "choice":
        extra = {"structured_outputs": {"choice": CHOICES}}
    r = client.completions.create(
        model=MODEL, prompt=f"Request {i}:", max_tokens=16, temperature=0, extra_body=extra
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length"), (i, choice.finish_reason)
    if kind == "regex":
        assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.text), choice.text
    if kind == "choice":
        assert choice.text in CHOICES, choice.text
    return kind, choice.text


def test_64_mixed_requests_with_grammar_affinity(cluster: Cluster) -> None:
    before = cluster.metrics()
    hits0 = metric(before, "baton_dp_routed_by_affinity_total", 'outcome="hit"')
    client = cluster.client()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: _request(client, i), range(64)))
    assert len(results) == 64
    text = cluster.metrics()
    # 16 JSON (3 schemas), 16 regex (1), 16 choice (1): 5 grammars, each new once.
    assert metric(text, "baton_dp_routed_by_affinity_total", 'outcome="new"') == 5
    assert metric(text, "baton_dp_routed_by_affinity_total", 'outcome="miss"') == 0
    assert metric(text, "baton_dp_routed_by_affinity_total", 'outcome="hit"') - hits0 == 48 - 5
    routed = [metric(text, "baton_replica_requests_routed_total", f'replica="{i}"') for i in (0, 1)]
    assert sum(routed) == 64 and min(routed) > 0, routed
    # Each grammar was compiled on one replica only: the compiles add up to the 5 grammars.
    deadline = time.monotonic() + 10
    while True:  # the replicas' stats are polled every half second
        compiles = [
            metric(cluster.metrics(), "baton_replica_grammar_compiles_total", f'replica="{i}"')
            for i in (0, 1)
        ]
        if sum(compiles) >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(compiles) == 5, compiles
    assert metric(text, "baton_requests_total", 'status="error"') == 0
    body = cluster.health().json()
    assert body["status"] == "ok"
    assert [r["healthy"] for r in body["replicas"]] == [True, True]


def test_streams_and_disconnects_through_replicas(cluster: Cluster) -> None:
    client = cluster.client()
    # A streamed structured request: its chunks add up to a valid instance.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Streamed item as JSON."}],
        max_tokens=48,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "item", "schema": SCHEMAS[1]},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    # A client that goes away mid-stream: its request is aborted on its replica.
    before = cluster.metrics()
    aborted0 = metric(before, "baton_requests_total", 'status="aborted"')
    steps0 = metric(before, "baton_engine_steps_total")
    with httpx.stream(
        "POST",
        f"{cluster.base}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "A long story:",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    # The replicas' stats are polled twice a second: wait until they show the request's
    # steps, give its replica time to go on if it had not been told, then look.
    deadline = time.monotonic() + 30
    while metric(cluster.metrics(), "baton_engine_steps_total") <= steps0:
        assert time.monotonic() < deadline, "the replicas' stats never showed the request"
        time.sleep(0.1)
    time.sleep(2.0)
    text = cluster.metrics()
    assert metric(text, "baton_requests_total", 'status="aborted"') == aborted0 + 1
    running = sum(metric(text, "baton_replica_requests_running", f'replica="{i}"') for i in (0, 1))
    assert running == 0
    # The replica stopped decoding when the client left: far fewer steps than 1000 tokens.
    assert metric(text, "baton_engine_steps_total") - steps0 < 500


def _plain(client: openai.OpenAI, i: int) -> str:
    try:
        r = client.completions.create(
            model=MODEL,
            prompt=f"Story {i}:",
            max_tokens=64,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    except openai.APIStatusError as exc:
        return f"error {exc.status_code}: {exc.message}"
    assert len(r.choices[0].text) > 0
    return "ok"


def test_a_killed_replica_loses_only_requests_it_had_started(cluster: Cluster) -> None:
    engine = cluster.engine
    client = cluster.client()
    retried0 = metric(cluster.metrics(), "baton_dp_retried_requests_total")
    n = 4 * MAX_NUM_SEQS  # each replica gets 2x what it runs at once: half of them wait
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_plain, client, i) for i in range(n)]
        deadline = time.monotonic() + 60
        # Killed while it runs requests and has others waiting (no output yet: those are the
        # ones retried). On a loaded machine the clients' requests arrive slowly, and a kill
        # right after the first one starts may find nothing waiting yet.
        while True:
            text = cluster.metrics()
            running = metric(text, "baton_replica_requests_running", 'replica="0"')
            waiting = metric(text, "baton_replica_requests_waiting", 'replica="0"')
            if running >= 1 and waiting >= 1:
                break
            assert time.monotonic() < deadline, f"replica 0: {running} running, {waiting} waiting"
            time.sleep(0.05)
        pid = engine.replica_pid(0)
        os.kill(pid, signal.SIGKILL)
        outcomes = [f.result(timeout=300) for f in futures]
    failed = [o for o in outcomes if o != "ok"]
    # Only requests replica 0 was running can fail, each with a message naming it.
    assert len(failed) <= MAX_NUM_SEQS, failed
    for o in failed:
        assert o.startswith("error 503") and "replica 0 died" in o, o
    text = cluster.metrics()
    assert metric(text, "baton_dp_retried_requests_total") - retried0 >= 1
    # Ray restarts the replica; it takes requests again.
    deadline = time.monotonic() + 180
    while True:
        body = cluster.health().json()
        if [r["healthy"] for r in body["replicas"]] == [True, True]:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    assert body["replicas"][0]["restarts"] == 1
    assert engine.replica_pid(0) != pid
    assert [_plain(client, i) for i in range(4)] == ["ok"] * 4
