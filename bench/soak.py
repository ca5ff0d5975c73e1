"""Reliability soak of ``baton serve``: many mixed requests over loopback, then health checks.

Starts ``baton serve`` as a subprocess on a free loopback port and sends ``--requests``
requests at ``--concurrency``: free text, JSON schema, regex and choice constraints (chat and
text completions, streamed or not), 10% invalid constraints and 10% streaming clients that hang
up mid-stream. It samples the server's resident memory (VmRSS) as it goes, then checks and
prints the pass criteria:

- every valid request completes (finish_reason stop or length) and, when it stopped by
  itself, its output matches its constraint (schema, regex, choice);
- every invalid request gets a 400; no response is a 5xx;
- every KV block is free and nothing runs or waits once the load is over (from /metrics);
- the server's VmRSS grows less than 10% from the first quarter of the run to the last;
- /health answers 200 afterwards, and SIGTERM stops the server with exit status 0.

The run is bounded: it sends no new request after ``--time-limit`` seconds and every request
has a timeout. The server is stopped at the end, also on errors. Writes JSON (default
bench/results/soak.json) and a PNG of RSS and in-flight requests over time.

    python -m baton.bench.soak [--tiny] [--requests 2000] [--concurrency 64]
        [--max-tokens 32] [--time-limit 900] [--model PATH] [--server-arg=--max-num-seqs=32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from baton.bench.common import add_common_args, config_from_args, write_results
from baton.bench.plotting import pyplot
from baton.bench.serve import free_port, parse_metrics, write_tiny_model_dir
from baton.engine.loader import load_tokenizer

VALID_KINDS = ("text", "json", "regex", "choice")
KINDS = (*VALID_KINDS, "invalid", "disconnect")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Disconnecting clients ask for this many times --max-tokens, so that they really hang up
# mid-stream rather than after the end.
DISCONNECT_TOKEN_FACTOR = 8
_LOG_TAIL_CHARS = 4000

# Constraints that the server must refuse with a 400 (one per kind of mistake).
INVALID_SPECS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "bad",
                    "schema": {"type": "object", "properties": {"age": {"type": "nonsense"}}},
                },
            }
        },
    ),
    (COMPLETIONS, {"structured_outputs": {"json": {"type": "integer", "minimum": "zero"}}}),
    (COMPLETIONS, {"structured_outputs": {"regex": "([a-z"}}),
    (CHAT, {"structured_outputs": {"choice": []}}),
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "required": "name"}},
            }
        },
    ),
)


# ------------------------------------------------------------------ config
@dataclass(frozen=True)
class SoakConfig:
    """One soak run.

    Attributes:
        requests: requests to send (the run also stops sending at ``time_limit_s``).
        concurrency: requests in flight at once.
        max_tokens: max_tokens of each valid request.
        time_limit_s: no request is sent after this many seconds of load.
        model: GGUF file or HF folder to serve (None: the default model).
        tiny: serve a tiny random-weight model written to a temporary folder instead.
        invalid_fraction: share of requests with an invalid constraint (400 expected).
        disconnect_fraction: share of streaming requests whose client hangs up mid-stream.
        stream_fraction: share of the valid requests that stream.
        seed: seeds the request mix and each request's sampling.
        request_timeout_s: longest wait for one response.
        startup_timeout_s: longest wait for the server's first healthy /health.
        rss_growth_limit: largest accepted VmRSS growth, first quarter to last quarter.
        check_rss: judge the RSS growth (a very short run has no steady state to judge).
        sample_interval_s: time between two VmRSS samples.
        server_args: extra ``baton serve`` options.

    Raises:
        ValueError: naming the field out of range.
    """

    requests: int = 2000
    concurrency: int = 64
    max_tokens: int = 32
    time_limit_s: float = 900.0
    model: str | None = None
    tiny: bool = False
    invalid_fraction: float = 0.1
    disconnect_fraction: float = 0.1
    stream_fraction: float = 0.5
    seed: int = 0
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 300.0
    rss_growth_limit: float = 0.10
    check_rss: bool = True
    sample_interval_s: float = 0.25
    server_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in (
            "time_limit_s",
            "request_timeout_s",
            "startup_timeout_s",
            "rss_growth_limit",
            "sample_interval_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        for name in ("invalid_fraction", "disconnect_fraction", "stream_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {v!r}")
        if self.invalid_fraction + self.disconnect_fraction > 1.0:
            raise ValueError(
                "invalid_fraction + disconnect_fraction must be <= 1, got "
                f"{self.invalid_fraction} + {self.disconnect_fraction}"
            )
        if self.tiny and self.model is not None:
            raise ValueError("give either model or tiny, not both")


# ---------------------------------------------------------------- requests
@dataclass(frozen=True)
class SoakRequest:
    """One planned request: where it goes, its body and what its answer must satisfy.

    ``check`` holds the constraint to verify on a stopped output ("schema", "regex" or
    "choices"); ``disconnect_after`` is the number of SSE events a disconnecting client
    reads before hanging up (0 for the others).
    """

    index: int
    kind: str
    path: str
    body: dict[str, Any]
    check: dict[str, Any]
    disconnect_after: int = 0

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def person_schema(variant: int) -> dict[str, Any]:
    """A small bounded object schema; ``variant`` changes one bound (a different grammar)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 1 + variant % 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "ok", "color"],
        "additionalProperties": False,
    }


def code_regex(variant: int) -> str:
    """A short anchored pattern; ``variant`` changes its repeat count."""
    return rf"[0-9]{{{1 + variant % 4}}}-[a-z]{{2}}"


def color_choices(variant: int) -> list[str]:
    """A few choices, one of them depending on ``variant``."""
    return ["red", "green", "blue", f"shade{variant}"]


def plan_requests(config: SoakConfig) -> list[SoakRequest]:
    """The whole request mix, shuffled; deterministic for a given config.

    Exactly ``round(requests * fraction)`` invalid and disconnecting requests; the rest split
    evenly over free text, JSON schema, regex and choice.
    """
    rng = random.Random(config.seed)
    n = config.requests
    n_invalid = round(n * config.invalid_fraction)
    n_disconnect = round(n * config.disconnect_fraction)
    rest = n - n_invalid - n_disconnect
    kinds = (
        ["invalid"] * n_invalid
        + ["disconnect"] * n_disconnect
        + [VALID_KINDS[i % len(VALID_KINDS)] for i in range(rest)]
    )
    rng.shuffle(kinds)
    seen: Counter[str] = Counter()
    plan = []
    for i, kind in enumerate(kinds):
        plan.append(_make_request(i, kind, seen[kind], rng, config))
        seen[kind] += 1
    return plan


def _make_request(
    index: int, kind: str, ordinal: int, rng: random.Random, config: SoakConfig
) -> SoakRequest:
    """Request ``index`` of ``kind``, the ``ordinal``-th of its kind."""
    variant = rng.randrange(16)
    chat = rng.random() < 0.5
    path = CHAT if chat else COMPLETIONS
    body: dict[str, Any] = {
        "max_tokens": config.max_tokens,
        "temperature": 1.0,
        "seed": index,
        "stream": rng.random() < config.stream_fraction,
    }
    check: dict[str, Any] = {}
    disconnect_after = 0
    if kind == "json":
        schema = person_schema(variant)
        check = {"schema": schema}
        if chat:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema},
            }
        else:
            body["structured_outputs"] = {"json": schema}
    elif kind == "regex":
        pattern = code_regex(variant)
        check = {"regex": pattern}
        body["structured_outputs"] = {"regex": pattern}
    elif kind == "choice":
        choices = color_choices(variant)
        check = {"choices": choices}
        body["structured_outputs"] = {"choice": choices}
    elif kind == "invalid":
        path, extra = INVALID_SPECS[ordinal % len(INVALID_SPECS)]
        chat = path == CHAT
        body.update(extra)
    elif kind == "disconnect":
        body.update(
            stream=True,
            ignore_eos=True,
            max_tokens=config.max_tokens * DISCONNECT_TOKEN_FACTOR,
        )
        disconnect_after = rng.randint(1, 4)
    elif kind != "text":
        raise ValueError(f"unknown request kind {kind!r}; expected one of {KINDS}")
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {index}: describe a person."}]
    else:
        body["prompt"] = f"Request {index}: a person is"
    return SoakRequest(index, kind, path, body, check, disconnect_after)


# ----------------------------------------------------------------- outcomes
@dataclass
class Outcome:
    """What one request got. ``ok`` says whether it met its kind's criterion."""

    index: int
    kind: str
    stream: bool
    status: int  # 0: no HTTP answer (transport error or timeout)
    ok: bool
    finish_reason: str | None = None
    checked: bool = False  # a stopped structured output was verified
    problem: str | None = None
    latency_s: float = 0.0


def verify_output(req: SoakRequest, text: str) -> str | None:
    """Why ``text`` (an output that stopped by itself) breaks ``req``'s constraint, or None."""
    if "schema" in req.check:
        try:
            jsonschema.validate(json.loads(text), req.check["schema"])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            return f"output is not schema-valid JSON ({type(exc).__name__}): {text[:120]!r}"
    elif "regex" in req.check:
        if re.fullmatch(req.check["regex"], text) is None:
            return f"output {text[:120]!r} does not match {req.check['regex']!r}"
    elif "choices" in req.check and text not in req.check["choices"]:
        return f"output {text[:120]!r} is not one of {req.check['choices']}"
    return None


def _judge(req: SoakRequest, out: Outcome, text: str | None) -> Outcome:
    """Fills ``ok``/``problem`` of a valid request that got a 200."""
    if out.finish_reason not in ("stop", "length"):
        out.problem = f"finish_reason {out.finish_reason!r}"
        return out
    if out.finish_reason == "stop" and req.check and text is not None:
        out.checked = True
        out.problem = verify_output(req, text)
        if out.problem is not None:
            return out
    out.ok = True
    return out


async def send(client: httpx.AsyncClient, req: SoakRequest, timeout_s: float) -> Outcome:
    """Sends one request and judges its answer; never raises for a failed request."""
    t0 = time.perf_counter()
    out = Outcome(req.index, req.kind, req.stream, 0, False)
    try:
        if req.stream:
            await asyncio.wait_for(_send_stream(client, req, out), timeout_s)
        else:
            await asyncio.wait_for(_send_plain(client, req, out), timeout_s)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong is this request's outcome
        out.ok = False
        out.problem = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - t0
    return out


def _expect_error_status(req: SoakRequest, out: Outcome, body: str) -> None:
    if req.kind == "invalid":
        out.ok = out.status == 400
        if not out.ok:
            out.problem = f"invalid request got HTTP {out.status}, expected 400: {body[:200]}"
    else:
        out.problem = f"HTTP {out.status}: {body[:200]}"


async def _send_plain(client: httpx.AsyncClient, req: SoakRequest, out: Outcome) -> None:
    r = await client.post(req.path, json=req.body)
    out.status = r.status_code
    if r.status_code != 200:
        _expect_error_status(req, out, r.text)
        return
    if req.kind == "invalid":
        out.problem = "invalid request got HTTP 200, expected 400"
        return
    choice = r.json()["choices"][0]
    out.finish_reason = choice.get("finish_reason")
    text = choice["message"]["content"] if req.path == CHAT else choice["text"]
    _judge(req, out, text)


async def _send_stream(client: httpx.AsyncClient, req: SoakRequest, out: Outcome) -> None:
    async with client.stream("POST", req.path, json=req.body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            _expect_error_status(req, out, (await r.aread()).decode(errors="replace"))
            return
        if req.kind == "invalid":
            out.problem = "invalid request got HTTP 200, expected 400"
            return
        parts: list[str] = []
        events = 0
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events += 1
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.problem = f"error event: {event['error'].get('message')}"
                return
            for choice in event.get("choices", []):
                if req.path == CHAT:
                    parts.append(choice.get("delta", {}).get("content") or "")
                else:
                    parts.append(choice.get("text") or "")
                if choice.get("finish_reason") is not None:
                    out.finish_reason = choice["finish_reason"]
            if req.disconnect_after and events >= req.disconnect_after:
                # Leaving the block closes the connection mid-stream: that is the test.
                out.ok = True
                return
    if req.kind == "disconnect":
        # It finished before the client could hang up: still a clean answer.
        out.ok = done and out.finish_reason in ("stop", "length")
        if not out.ok:
            out.problem = f"stream ended early (done={done}, finish={out.finish_reason!r})"
        return
    if not done:
        out.problem = "stream ended without [DONE]"
        return
    _judge(req, out, "".join(parts))


# ------------------------------------------------------------------ server
def serve_command(model: str | None, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line of a ``baton serve`` on loopback ``port``."""
    cmd = [sys.executable, "-m", "baton.engine.entrypoints.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning"]
    if model is not None:
        cmd += ["--model", model]
    return cmd + list(extra)


class ServerProcess:
    """A ``baton serve`` subprocess on a free loopback port, its output going to ``log_path``.

    Use as a context manager: leaving it stops the server (SIGTERM, then SIGKILL after
    ``kill_after_s``) if it still runs.

    Raises:
        RuntimeError: (from ``wait_ready``) the server exited or stayed unhealthy.
    """

    def __init__(self, model: str | None, log_path: Path, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            serve_command(model, self.port, extra),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        """The end of the server's output."""
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-_LOG_TAIL_CHARS:]

    def wait_ready(self, timeout_s: float) -> float:
        """Waits for /health to answer 200; returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"baton serve exited with {code}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(
                    f"baton serve not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def terminate(self, timeout_s: float) -> tuple[int | None, float]:
        """Sends SIGTERM and waits; returns (exit status or None if it had to be killed,
        seconds until it exited)."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        return code, time.monotonic() - t0

    def stop(self, kill_after_s: float = 10.0) -> None:
        """Stops the server if it still runs; idempotent."""
        if self.proc.poll() is None:
            self.terminate(kill_after_s)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_rss_kb(pid: int) -> int | None:
    """The resident set size of process ``pid`` in kB (VmRSS), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def wait_idle(base: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and every KV block is free (or at the timeout);
    empty when the server does not answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            m = parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)
        except httpx.HTTPError:
            return {}
        idle = (
            m.get("baton_num_requests_running") == 0
            and m.get("baton_num_requests_waiting") == 0
            and m.get("baton_kv_free_blocks") == m.get("baton_kv_total_blocks")
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# -------------------------------------------------------------------- load
@dataclass
class LoadRun:
    """The client side of one soak: every outcome and the samples taken."""

    outcomes: list[Outcome]
    samples: list[dict[str, float]]
    seconds: float
    stopped_by_time_limit: bool


async def run_load(
    base: str, pid: int, requests: Sequence[SoakRequest], config: SoakConfig
) -> LoadRun:
    """Sends ``requests`` at ``config.concurrency``, sampling the server's VmRSS meanwhile."""
    outcomes: list[Outcome] = []
    samples: list[dict[str, float]] = []
    pending = iter(requests)
    in_flight = 0
    stopped = False
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=None)

    def sample() -> None:
        rss = read_rss_kb(pid)
        if rss is not None:
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 3),
                    "rss_mb": rss / 1024,
                    "in_flight": in_flight,
                    "done": len(outcomes),
                }
            )

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(config.sample_interval_s)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal in_flight, stopped
        for req in pending:
            if time.monotonic() - t0 > config.time_limit_s:
                stopped = True
                return
            in_flight += 1
            try:
                outcomes.append(await send(client, req, config.request_timeout_s))
            finally:
                in_flight -= 1

    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        sampling = asyncio.ensure_future(sampler())
        try:
            await asyncio.gather(*(worker(client) for _ in range(config.concurrency)))
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
    sample()
    return LoadRun(outcomes, samples, time.monotonic() - t0, stopped)


# ------------------------------------------------------------------ figures
def rss_quarters(samples: Sequence[dict[str, float]]) -> tuple[float | None, float | None]:
    """Median VmRSS (MB) over the first and the last quarter of the run's duration (None for a
    quarter without samples)."""
    if not samples:
        return None, None
    end = samples[-1]["t"]
    first = [s["rss_mb"] for s in samples if s["t"] <= end / 4]
    last = [s["rss_mb"] for s in samples if s["t"] >= end * 3 / 4]
    return (
        statistics.median(first) if first else None,
        statistics.median(last) if last else None,
    )


def summarize(
    config: SoakConfig,
    planned: int,
    load: LoadRun,
    metrics: dict[str, float],
    health_status: int,
    exit_code: int | None,
    exit_s: float,
) -> dict[str, Any]:
    """The figures, the criteria (name: met) and whether all were met."""
    outs = load.outcomes
    by_kind = Counter(o.kind for o in outs)
    valid = [o for o in outs if o.kind in VALID_KINDS]
    invalid = [o for o in outs if o.kind == "invalid"]
    disconnect = [o for o in outs if o.kind == "disconnect"]
    statuses = Counter(str(o.status) for o in outs)
    latencies = sorted(o.latency_s for o in valid)
    first_mb, last_mb = rss_quarters(load.samples)
    growth = None if first_mb is None or last_mb is None else last_mb / first_mb - 1.0
    figures: dict[str, Any] = {
        "requests_planned": planned,
        "requests_sent": len(outs),
        "stopped_by_time_limit": load.stopped_by_time_limit,
        "seconds": round(load.seconds, 2),
        "requests_per_s": round(len(outs) / load.seconds, 2) if load.seconds else None,
        "by_kind": dict(sorted(by_kind.items())),
        "status_counts": dict(sorted(statuses.items())),
        "valid": len(valid),
        "valid_completed": sum(o.ok for o in valid),
        "finish_reasons": dict(sorted(Counter(str(o.finish_reason) for o in valid).items())),
        "structured_stopped_checked": sum(o.checked for o in valid),
        "structured_invalid_output": sum(o.checked and not o.ok for o in valid),
        "invalid": len(invalid),
        "invalid_400": sum(o.status == 400 for o in invalid),
        "disconnect": len(disconnect),
        "disconnect_clean": sum(o.ok for o in disconnect),
        "http_5xx": sum(o.status >= 500 for o in outs),
        "no_answer": sum(o.status == 0 for o in outs),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
        "latency_p99_s": (
            round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3)
            if latencies
            else None
        ),
        "kv_free_blocks": metrics.get("baton_kv_free_blocks"),
        "kv_total_blocks": metrics.get("baton_kv_total_blocks"),
        "num_running_after": metrics.get("baton_num_requests_running"),
        "num_waiting_after": metrics.get("baton_num_requests_waiting"),
        "server_requests_total": {
            s: metrics.get(f'baton_requests_total{{status="{s}"}}')
            for s in ("finished", "aborted", "error", "rejected")
        },
        "rss_first_quarter_mb": None if first_mb is None else round(first_mb, 1),
        "rss_last_quarter_mb": None if last_mb is None else round(last_mb, 1),
        "rss_growth": None if growth is None else round(growth, 4),
        "rss_growth_mb": None if growth is None else round(last_mb - first_mb, 1),
        "rss_peak_mb": round(max(s["rss_mb"] for s in load.samples), 1) if load.samples else None,
        "health_after": health_status,
        "sigterm_exit_code": exit_code,
        "sigterm_exit_s": round(exit_s, 2),
    }
    criteria: dict[str, bool] = {
        "every_valid_request_completed": figures["valid_completed"] == len(valid),
        "every_invalid_request_got_400": figures["invalid_400"] == len(invalid),
        "every_disconnect_clean": figures["disconnect_clean"] == len(disconnect),
        "no_5xx": figures["http_5xx"] == 0,
        "all_kv_blocks_free": (
            metrics.get("baton_kv_total_blocks") is not None
            and metrics.get("baton_kv_free_blocks") == metrics.get("baton_kv_total_blocks")
            and metrics.get("baton_num_requests_running") == 0
            and metrics.get("baton_num_requests_waiting") == 0
        ),
        "health_ok_after": health_status == 200,
        "sigterm_exit_0": exit_code == 0,
    }
    if config.check_rss:
        criteria["rss_growth_below_limit"] = growth is not None and growth < config.rss_growth_limit
    problems = [f"#{o.index} {o.kind}: {o.problem}" for o in outs if o.problem and not o.ok]
    return {
        "figures": figures,
        "criteria": criteria,
        "passed": all(criteria.values()),
        "problems": problems[:50],
    }


# --------------------------------------------------------------------- run
def _health_status(base: str) -> int:
    """The status of GET /health, 0 when the server does not answer."""
    try:
        return httpx.get(f"{base}/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


@contextmanager
def _model_path(config: SoakConfig) -> Iterator[str | None]:
    if not config.tiny:
        yield config.model
        return
    with tempfile.TemporaryDirectory(prefix="baton-soak-") as tmp:
        yield str(write_tiny_model_dir(Path(tmp) / "tiny-random-llama", load_tokenizer()))


def run_soak(config: SoakConfig, log_path: Path | None = None) -> dict[str, Any]:
    """Runs one soak against a fresh ``baton serve`` and returns the result (config, figures,
    criteria, ``passed``, problems, samples). The server is stopped however it ends.

    Raises:
        RuntimeError: the server did not start (its output is in the message).
    """
    requests = plan_requests(config)
    with _model_path(config) as model, tempfile.TemporaryDirectory(prefix="baton-soak-") as tmp:
        log = log_path or Path(tmp) / "serve.log"
        with ServerProcess(model, log, config.server_args) as server:
            startup_s = server.wait_ready(config.startup_timeout_s)
            load = asyncio.run(run_load(server.base, server.pid, requests, config))
            metrics = wait_idle(server.base)
            health = _health_status(server.base)
            exit_code, exit_s = server.terminate(timeout_s=60.0)
            tail = server.log_tail()
        result = summarize(config, len(requests), load, metrics, health, exit_code, exit_s)
    result["figures"]["startup_s"] = round(startup_s, 2)
    result["config"] = {**asdict(config), "model": model if not config.tiny else "tiny"}
    result["samples"] = load.samples
    if not result["passed"]:
        result["server_log_tail"] = tail
    return result


def print_report(result: dict[str, Any]) -> None:
    """The figures and each criterion, one per line."""
    f = result["figures"]
    print(
        f"soak: {f['requests_sent']}/{f['requests_planned']} requests in {f['seconds']} s "
        f"({f['requests_per_s']} req/s){'  [time limit hit]' if f['stopped_by_time_limit'] else ''}"
    )
    for key, value in f.items():
        if key not in ("requests_sent", "requests_planned", "seconds", "requests_per_s"):
            print(f"  {key:28s} {value}")
    for name, met in result["criteria"].items():
        print(f"  [{'PASS' if met else 'FAIL'}] {name}")
    for problem in result["problems"][:10]:
        print(f"  problem: {problem}")
    print("PASSED" if result["passed"] else "FAILED")


def plot(result: dict[str, Any], png: Path) -> None:
    """Server VmRSS and requests in flight over time."""
    plt = pyplot()
    if plt is None or not result["samples"]:
        return
    t = [s["t"] for s in result["samples"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, [s["rss_mb"] for s in result["samples"]])
    ax1.set_ylabel("server VmRSS (MB)")
    growth = result["figures"]["rss_growth"]
    ax1.set_title(f"baton serve soak (RSS growth {growth if growth is None else f'{growth:+.1%}'})")
    ax2.plot(t, [s["in_flight"] for s in result["samples"]], color="tab:orange")
    ax2.set_ylabel("requests in flight")
    ax2.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="baton bench soak",
        description="Reliability soak of baton serve (mixed, invalid and abandoned requests).",
    )
    d = SoakConfig()
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument(
        "--time-limit",
        type=float,
        dest="time_limit_s",
        metavar="SECONDS",
        default=d.time_limit_s,
        help="seconds before sending stops",
    )
    p.add_argument("--tiny", action="store_true", help="serve a tiny random-weight model")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--request-timeout",
        type=float,
        dest="request_timeout_s",
        metavar="SECONDS",
        default=d.request_timeout_s,
    )
    p.add_argument(
        "--no-rss-check",
        action="store_false",
        dest="check_rss",
        help="report the RSS growth but do not judge it",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        dest="server_args",
        default=[],
        metavar="ARG",
        help="extra baton serve option, repeatable (e.g. --server-arg=--max-num-seqs=32)",
    )
    add_common_args(p, "soak", dtype=None)
    p.add_argument("--log", type=Path, default=None, help="keep the server's output here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the soak from the command line; returns 0 when every criterion is met, else 1."""
    parser = build_parser()
    a = parser.parse_args(argv)
    config = config_from_args(parser, a, SoakConfig)
    result = run_soak(config, a.log)
    print_report(result)
    write_results(result, a.out, plot)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
