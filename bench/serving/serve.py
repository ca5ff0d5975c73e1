"""Serving benchmark: a load test of ``baton serve`` by concurrent streaming clients.

Starts ``baton serve`` as a subprocess on a free loopback port (the default model, any
``--model``, or with ``--tiny`` a tiny random-weight model over the real vocabulary, written
to a temporary Hugging Face folder), waits for ``/health``, warms it up, then for each
concurrency level runs that many clients that send greedy streaming chat requests (a mix
of free requests, which ignore EOS, and JSON-schema ones) until the level's request count
or time limit is reached. Per request it records, client-side: TTFT (first content chunk),
TPOT ((last token - first token) / (tokens - 1), tokens from the usage chunk), latency,
output tokens, HTTP or stream errors, and for JSON requests that stopped by themselves
whether the text validates against the schema (a JSON request cut by ``--max-tokens``
cannot be judged: those are counted apart, as length-cut). Per level it reports throughput and
TTFT/TPOT percentiles, plus the engine counters scraped from ``/metrics``. The server is
stopped at the end, also on errors and Ctrl-C. Prints a table and writes JSON and a PNG.

    baton bench serve [--concurrency 1,8,32] [--requests N] [--time-limit S] [--dtype auto]
        [--json-fraction 0.5] [--max-tokens 64] [--tiny] [--server-arg=--no-async-scheduling]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from baton.bench.common import add_common_args, config_from_args, csv_of, write_results
from baton.bench.offline.engine import SCHEMA, TinyModelShape, conversations
from baton.bench.serving.serve_report import plot, print_report
from baton.bench.serving.server_process import (
    COMPUTE_INFO,
    ServerProcess,
    parse_metrics,
    served_dtype,
    sigterm_as_exit,
    write_tiny_model_dir,
)

API_KEY_ENV = "BATON_API_KEY"  # the server reads it too (see baton.engine.server.serve)
WARMUP_TOKENS = 16
MIN_REQUESTS = 8
# Engine figures kept from /metrics; counters are also reported as per-level deltas.
ENGINE_COUNTERS = ("baton_engine_steps_total", "baton_deferred_steps_total")
ENGINE_GAUGES = ("baton_device_busy_fraction",)
SERVER_MEANS = {
    "server_ttft_mean_ms": "baton_time_to_first_token_seconds",
    "server_tpot_mean_ms": "baton_time_per_output_token_seconds",
}


@dataclass(frozen=True)
class ServeBenchConfig:
    """What one load test runs; raises ``ValueError`` naming a bad field.

    ``requests`` None means ``max(MIN_REQUESTS, 2 * concurrency)`` per level.
    """

    concurrency: tuple[int, ...] = (1, 8, 32)
    requests: int | None = None
    time_limit_s: float = 120.0
    json_fraction: float = 0.5
    max_tokens: int = 64
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive ints, got {list(self.concurrency)}")
        if len(set(self.concurrency)) != len(self.concurrency):
            raise ValueError(f"concurrency must not repeat a value, got {list(self.concurrency)}")
        if self.requests is not None and self.requests <= 0:
            raise ValueError(f"requests must be a positive int, got {self.requests}")
        if not 0.0 <= self.json_fraction <= 1.0:
            raise ValueError(f"json_fraction must lie in [0, 1], got {self.json_fraction}")
        if self.max_tokens < 2:
            raise ValueError(
                f"max_tokens must be >= 2 (TPOT needs two tokens), got {self.max_tokens}"
            )
        for name in ("time_limit_s", "request_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def requests_at(self, concurrency: int) -> int:
        """Requests issued at one level (fewer when its time limit comes first)."""
        return self.requests if self.requests is not None else max(MIN_REQUESTS, 2 * concurrency)


@dataclass(frozen=True)
class RequestRecord:
    """One streamed request as the client saw it (times in seconds, None when not reached)."""

    concurrency: int
    index: int
    structured: bool
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float
    output_tokens: int | None
    finish_reason: str | None
    json_valid: bool | None
    error: str | None


# ---------------------------------------------------------------- the clients
def is_structured(index: int, json_fraction: float) -> bool:
    """Whether request ``index`` of a level asks for JSON: spread evenly, ``json_fraction``
    of every run of requests."""
    return math.floor((index + 1) * json_fraction) > math.floor(index * json_fraction)


def request_body(
    model: str, messages: list[dict[str, str]], structured: bool, max_tokens: int
) -> dict[str, Any]:
    """A greedy streaming chat request with usage in its last chunk; a free one ignores EOS
    (so that every free request costs ``max_tokens``), a structured one follows ``SCHEMA``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA},
        }
    else:
        body["ignore_eos"] = True
    return body


def json_validity(text: str) -> bool:
    """Whether ``text`` parses as JSON and validates against ``SCHEMA``."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


async def stream_request(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    concurrency: int,
    index: int,
) -> RequestRecord:
    """Sends one streaming chat request and times its chunks; never raises for HTTP, network
    or stream errors (they are recorded in ``error``)."""
    structured = "response_format" in body
    t0 = time.perf_counter()
    first: float | None = None
    last_token: float | None = None
    text: list[str] = []
    tokens: int | None = None
    finish: str | None = None
    error: str | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:200]
                error = f"HTTP {response.status_code}: {detail}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"stream error: {chunk['error']}"[:200]
                        break
                    now = time.perf_counter()
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            text.append(content)
                            first = now if first is None else first
                            last_token = now
                        if choice.get("finish_reason") is not None:
                            finish = choice["finish_reason"]
                            last_token = now
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.TimeoutException as exc:
        error = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        error = f"connection: {type(exc).__name__}: {exc}"[:200]
    except json.JSONDecodeError as exc:
        error = f"bad chunk: {exc}"
    latency = time.perf_counter() - t0
    if error is None and finish is None:
        error = "stream ended without a finish reason"
    tpot = None
    if first is not None and last_token is not None and tokens is not None and tokens > 1:
        tpot = (last_token - first) / (tokens - 1)
    valid = None
    if error is None and structured and finish == "stop":
        valid = json_validity("".join(text))
    return RequestRecord(
        concurrency=concurrency,
        index=index,
        structured=structured,
        ttft_s=None if first is None else first - t0,
        tpot_s=tpot,
        latency_s=latency,
        output_tokens=tokens,
        finish_reason=finish,
        json_valid=valid,
        error=error,
    )


@dataclass
class LevelRun:
    """The requests of one concurrency level and its wall time."""

    concurrency: int
    planned: int
    seconds: float
    records: list[RequestRecord] = field(default_factory=list)


async def run_level(
    client: httpx.AsyncClient,
    model: str,
    cfg: ServeBenchConfig,
    concurrency: int,
    first_prompt: int,
) -> LevelRun:
    """``concurrency`` clients pull the level's requests one at a time; none is issued after
    the time limit (requests in flight then still finish). Prompts are numbered from
    ``first_prompt`` so that no level reuses another's prefix cache."""
    planned = cfg.requests_at(concurrency)
    chats = conversations(first_prompt, planned)
    next_index = 0
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    deadline = t0 + cfg.time_limit_s

    async def worker() -> None:
        nonlocal next_index
        while next_index < planned and time.perf_counter() < deadline:
            index = next_index
            next_index += 1
            body = request_body(
                model, chats[index], is_structured(index, cfg.json_fraction), cfg.max_tokens
            )
            records.append(await stream_request(client, body, concurrency, index))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run = LevelRun(concurrency, planned, time.perf_counter() - t0)
    run.records = sorted(records, key=lambda r: r.index)
    return run


async def warm_up(client: httpx.AsyncClient, model: str, first_prompt: int, max_tokens: int) -> int:
    """Short requests outside the measurements: a free one and a JSON one alone (batch 1),
    then both together, so that first-call costs and the schema's compile are paid here.
    Returns how many prompts it used.

    Raises:
        RuntimeError: a warm-up request failed (the server cannot serve the benchmark).
    """
    chats = conversations(first_prompt, 4)
    tokens = min(max_tokens, WARMUP_TOKENS)
    bodies = [request_body(model, chat, i % 2 == 1, tokens) for i, chat in enumerate(chats)]
    records = [await stream_request(client, bodies[0], 0, -1)]
    records.append(await stream_request(client, bodies[1], 0, -1))
    records += await asyncio.gather(*(stream_request(client, b, 0, -1) for b in bodies[2:]))
    errors = [r.error for r in records if r.error is not None]
    if errors:
        raise RuntimeError(f"warm-up request failed: {errors[0]}")
    return len(chats)


# ---------------------------------------------------------------- /metrics
async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's ``/metrics`` now. Raises ``httpx.HTTPError`` when it does not answer."""
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


# ---------------------------------------------------------------- summaries
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarize_level(
    run: LevelRun, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """One table row: counts, throughput, client-side percentiles and the engine counters
    this level added."""
    ok = [r for r in run.records if r.error is None]
    errors: dict[str, int] = {}
    for r in run.records:
        if r.error is not None:
            kind = r.error.split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    tokens = sum(r.output_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    latencies = [r.latency_s for r in ok]
    checked = [r for r in ok if r.json_valid is not None]
    valid = sum(1 for r in checked if r.json_valid)
    length_cut = sum(1 for r in ok if r.structured and r.finish_reason == "length")
    row: dict[str, Any] = {
        "concurrency": run.concurrency,
        "planned": run.planned,
        "issued": len(run.records),
        "done": len(ok),
        "failed": len(run.records) - len(ok),
        "errors": errors,
        "seconds": run.seconds,
        "output_tokens": tokens,
        "tok_per_s": tokens / run.seconds if run.seconds > 0 else None,
        "requests_per_s": len(ok) / run.seconds if run.seconds > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "tpot_p50_ms": _ms(percentile(tpots, 50)),
        "tpot_p99_ms": _ms(percentile(tpots, 99)),
        "latency_p50_ms": _ms(percentile(latencies, 50)),
        "latency_p99_ms": _ms(percentile(latencies, 99)),
        "json_requests": sum(1 for r in run.records if r.structured),
        "json_checked": len(checked),  # JSON requests that stopped by themselves
        "json_valid": valid,
        "json_valid_share": valid / len(checked) if checked else None,
        "json_length_cut": length_cut,
    }
    for name in ENGINE_COUNTERS:
        key = name.removeprefix("baton_").removesuffix("_total")
        row[key] = int(after.get(name, 0.0) - before.get(name, 0.0))
    # The server's own view of the same requests (its histograms' sum / count over the level):
    # client-side minus server-side is what HTTP, SSE and the client added.
    for key, name in SERVER_MEANS.items():
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        row[key] = total / count * 1e3 if count > 0 else None
    return row


def engine_metrics(samples: dict[str, float]) -> dict[str, float]:
    """The engine and request figures of a final ``/metrics`` scrape worth keeping."""
    keep = (*ENGINE_GAUGES, *ENGINE_COUNTERS, "baton_generation_tokens_total")
    out = {name: samples[name] for name in keep if name in samples}
    out.update({k: v for k, v in samples.items() if k.startswith("baton_requests_total{")})
    out.update({k: v for k, v in samples.items() if k.startswith(f"{COMPUTE_INFO}{{")})
    return out


# ------------------------------------------------------------------ running
async def run_benchmark(base: str, cfg: ServeBenchConfig) -> dict[str, Any]:
    """Warm-up, then every level in order against the server at ``base``; returns the rows,
    the per-request records and the final ``/metrics`` figures."""
    api_key = os.environ.get(API_KEY_ENV) or "none"
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0),
        limits=limits,
    ) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
        prompt = await warm_up(client, model, 0, cfg.max_tokens)
        rows: list[dict[str, Any]] = []
        records: list[dict[str, Any]] = []
        for concurrency in cfg.concurrency:
            before = await scrape(client)
            run = await run_level(client, model, cfg, concurrency, prompt)
            after = await scrape(client)
            prompt += run.planned
            rows.append(summarize_level(run, before, after))
            records += [asdict(r) for r in run.records]
        final = await scrape(client)
    return {
        "served_model": model,
        "rows": rows,
        "requests": records,
        "metrics": engine_metrics(final),
    }


def run(
    cfg: ServeBenchConfig,
    model: str | None,
    tiny: bool,
    dtype: str,
    server_args: Sequence[str],
) -> dict[str, Any]:
    """Starts the server (writing the tiny model first with ``tiny``), runs the benchmark
    and stops the server whatever happens.

    Raises:
        RuntimeError: the server did not start, or could not serve the warm-up.
        ValueError: a model path that cannot be read (from the tokenizer loader).
    """
    with tempfile.TemporaryDirectory(prefix="baton-bench-serve-") as tmp:
        served: str | None = model
        tiny_shape = None
        if tiny:
            from baton.engine.loader import load_tokenizer

            tiny_shape = TinyModelShape()
            served = str(
                write_tiny_model_dir(Path(tmp) / "tiny", load_tokenizer(model), tiny_shape)
            )
        server = ServerProcess(served, dtype=dtype, server_args=server_args)
        with server:
            server.wait_healthy(cfg.startup_timeout_s)
            result = asyncio.run(run_benchmark(server.base, cfg))
    return {
        "model": "tiny-random-llama" if tiny else (model or "default (SmolLM2-135M)"),
        "tiny_model": asdict(tiny_shape) if tiny_shape is not None else None,
        "tokenizer_from": model or "default (SmolLM2-135M)",
        # What the server computed in (--dtype auto resolves there), else what was asked.
        "dtype": served_dtype(result["metrics"]) or dtype,
        "dtype_asked": dtype,
        "server": {"command": server.command[1:], "pid": server.pid},
        "concurrency": list(cfg.concurrency),
        "requests_per_level": cfg.requests,
        "time_limit_s": cfg.time_limit_s,
        "json_fraction": cfg.json_fraction,
        "max_tokens": cfg.max_tokens,
        "schema": SCHEMA,
        "cpus": os.cpu_count(),
        **result,
    }


# ------------------------------------------------------------------ output


def main(argv: list[str] | None = None) -> int:
    """Runs the load test, prints the report and writes ``--out`` (JSON) and its PNG.

    Starts (and always stops) a ``baton serve`` subprocess; exits through argparse
    (SystemExit 2) on a bad argument. Raises ``RuntimeError`` when the server does not
    start or cannot serve the warm-up.
    """
    p = argparse.ArgumentParser(prog="baton bench serve", description=__doc__.splitlines()[0])
    # --model: the GGUF file or HF folder to serve; with --tiny, only its tokenizer.
    add_common_args(p, "serve", dtype=None)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="serve a tiny random-weight model with the real vocabulary (a quick run)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the server's --dtype (default: auto, the engine's own pick)",
    )
    p.add_argument(
        "--concurrency",
        type=csv_of(int),
        default=(1, 8, 32),
        help="client counts (default: 1,8,32)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per level (default: max({MIN_REQUESTS}, 2 x concurrency))",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        dest="time_limit_s",
        default=120.0,
        help="seconds per level after which no request is issued (default: 120)",
    )
    p.add_argument("--json-fraction", type=float, default=0.5, help="share of JSON-schema requests")
    p.add_argument("--max-tokens", type=int, default=64, help="max tokens per request")
    p.add_argument(
        "--startup-timeout",
        type=float,
        dest="startup_timeout_s",
        default=300.0,
        help="seconds to wait for /health",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to baton serve, repeatable (e.g. --server-arg=--no-async-scheduling)",
    )
    a = p.parse_args(argv)
    cfg = config_from_args(p, a, ServeBenchConfig)
    with sigterm_as_exit():
        result = run(cfg, a.model, a.tiny, a.dtype, a.server_arg)
    print_report(result)
    write_results(result, a.out, plot, dtype=result["dtype"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
