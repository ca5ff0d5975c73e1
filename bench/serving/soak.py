"""Reliability soak of ``baton serve``: many mixed requests over loopback, then health checks.

Starts ``baton serve`` as a subprocess on a free loopback port and sends ``--requests``
requests at ``--concurrency``: free text, JSON schema, regex and choice constraints (chat and
text completions, streamed or not), 10% invalid constraints and 10% streaming clients that hang
up mid-stream. It samples the resident memory (VmRSS) of the server and its worker processes
(model worker, grammar compile workers) as it goes, then checks and prints the pass criteria:

- every valid request completes (finish_reason stop or length) and, when it stopped by
  itself, its output matches its constraint (schema, regex, choice);
- every invalid request gets a 400; no response is a 5xx;
- every KV block is free and nothing runs or waits once the load is over (from /metrics);
- that VmRSS (server plus workers) grows less than 10% from the first quarter of the run to
  the last;
- /health answers 200 afterwards, and SIGTERM stops the server with exit status 0.

The run is bounded: it sends no new request after ``--time-limit`` seconds and every request
has a timeout. The server is stopped at the end, also on errors. Writes JSON (default
bench/results/soak.json) and a PNG of RSS and in-flight requests over time.

    python -m baton.bench.serving.soak [--tiny] [--requests 2000] [--concurrency 64]
        [--max-tokens 32] [--time-limit 900] [--model PATH] [--server-arg=--max-num-seqs=32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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

from baton.bench.common import add_common_args, config_from_args, write_results
from baton.bench.plotting import pyplot
from baton.bench.serving.server_process import (
    ServerProcess,
    parse_metrics,
    served_dtype,
    write_tiny_model_dir,
)
from baton.bench.serving.soak_requests import (
    VALID_KINDS,
    Outcome,
    SoakConfig,
    SoakRequest,
    plan_requests,
    send,
)
from baton.engine.loader import load_tokenizer


# ------------------------------------------------------------------ config
# ------------------------------------------------------------------ server
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


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The parent pid is the 2nd field after the ")" that ends the command name.
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def read_tree_rss_kb(pid: int) -> tuple[int, int] | None:
    """VmRSS in kB of process ``pid`` and the sum over its descendants (the model worker and
    the grammar compile workers of ``baton serve``), or None once ``pid`` is gone."""
    own = read_rss_kb(pid)
    if own is None:
        return None
    return own, sum(read_rss_kb(child) or 0 for child in descendants(pid))


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
    """Sends ``requests`` at ``config.concurrency``, sampling the VmRSS of the server and its
    workers meanwhile."""
    outcomes: list[Outcome] = []
    samples: list[dict[str, float]] = []
    pending = iter(requests)
    in_flight = 0
    stopped = False
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=None)

    def sample() -> None:
        rss = read_tree_rss_kb(pid)
        if rss is not None:
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 3),
                    # Judged: the server with its worker processes (with async scheduling the
                    # model and its KV cache live in the worker).
                    "rss_mb": (rss[0] + rss[1]) / 1024,
                    "server_rss_mb": rss[0] / 1024,
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


def _rss_growth(samples: Sequence[dict[str, float]]) -> float | None:
    """Returns the VmRSS growth from the first quarter's median to the last's (0.1: 10%), or
    None when a quarter has no samples."""
    first_mb, last_mb = rss_quarters(samples)
    return None if first_mb is None or last_mb is None else last_mb / first_mb - 1.0


def _request_figures(planned: int, load: LoadRun) -> dict[str, Any]:
    """Returns the client-side figures of one load: counts by kind and HTTP status, how many
    of each kind met their criterion, and the valid requests' latency percentiles."""
    outs = load.outcomes
    valid = [o for o in outs if o.kind in VALID_KINDS]
    invalid = [o for o in outs if o.kind == "invalid"]
    disconnect = [o for o in outs if o.kind == "disconnect"]
    latencies = sorted(o.latency_s for o in valid)
    return {
        "requests_planned": planned,
        "requests_sent": len(outs),
        "stopped_by_time_limit": load.stopped_by_time_limit,
        "seconds": round(load.seconds, 2),
        "requests_per_s": round(len(outs) / load.seconds, 2) if load.seconds else None,
        "by_kind": dict(sorted(Counter(o.kind for o in outs).items())),
        "status_counts": dict(sorted(Counter(str(o.status) for o in outs).items())),
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
    }


def _server_figures(metrics: dict[str, float]) -> dict[str, Any]:
    """Returns the server's figures after the load, read from its /metrics: dtype, KV blocks,
    requests still running or waiting, and its request totals by status."""
    return {
        "dtype": served_dtype(metrics),
        "kv_free_blocks": metrics.get("baton_kv_free_blocks"),
        "kv_total_blocks": metrics.get("baton_kv_total_blocks"),
        "num_running_after": metrics.get("baton_num_requests_running"),
        "num_waiting_after": metrics.get("baton_num_requests_waiting"),
        "server_requests_total": {
            s: metrics.get(f'baton_requests_total{{status="{s}"}}')
            for s in ("finished", "aborted", "error", "rejected")
        },
    }


def _rss_figures(samples: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Returns the VmRSS figures in MB (first and last quarter medians, growth, peaks of the
    tree and of the server alone); None where the samples do not tell."""
    first_mb, last_mb = rss_quarters(samples)
    growth = _rss_growth(samples)
    return {
        "rss_first_quarter_mb": None if first_mb is None else round(first_mb, 1),
        "rss_last_quarter_mb": None if last_mb is None else round(last_mb, 1),
        "rss_growth": None if growth is None else round(growth, 4),
        "rss_growth_mb": None if growth is None else round(last_mb - first_mb, 1),
        "rss_peak_mb": round(max(s["rss_mb"] for s in samples), 1) if samples else None,
        "server_rss_peak_mb": (
            round(max(s["server_rss_mb"] for s in samples), 1) if samples else None
        ),
    }


def _criteria(
    config: SoakConfig,
    figures: dict[str, Any],
    load: LoadRun,
    metrics: dict[str, float],
    health_status: int,
    exit_code: int | None,
) -> dict[str, bool]:
    """Returns each pass criterion (name: met), the RSS one only when ``config.check_rss``."""
    criteria: dict[str, bool] = {
        "every_valid_request_completed": figures["valid_completed"] == figures["valid"],
        "every_invalid_request_got_400": figures["invalid_400"] == figures["invalid"],
        "every_disconnect_clean": figures["disconnect_clean"] == figures["disconnect"],
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
        growth = _rss_growth(load.samples)
        criteria["rss_growth_below_limit"] = growth is not None and growth < config.rss_growth_limit
    return criteria


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
    figures: dict[str, Any] = {
        **_request_figures(planned, load),
        **_server_figures(metrics),
        **_rss_figures(load.samples),
        "health_after": health_status,
        "sigterm_exit_code": exit_code,
        "sigterm_exit_s": round(exit_s, 2),
    }
    criteria = _criteria(config, figures, load, metrics, health_status, exit_code)
    outs = load.outcomes
    problems = [f"#{o.index} {o.kind}: {o.problem}" for o in outs if o.problem and not o.ok]
    return {
        "figures": figures,
        "criteria": criteria,
        "passed": all(criteria.values()),
        "problems": problems[:50],
    }


# --------------------------------------------------------------------- run
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
        with ServerProcess(model, server_args=config.server_args, log_path=log) as server:
            startup_s = server.wait_healthy(config.startup_timeout_s)
            load = asyncio.run(run_load(server.base, server.pid, requests, config))
            metrics = wait_idle(server.base)
            health = server.health_status()
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
    """VmRSS (server plus workers, and the server alone) and requests in flight over time."""
    plt = pyplot()
    if plt is None or not result["samples"]:
        return
    t = [s["t"] for s in result["samples"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, [s["rss_mb"] for s in result["samples"]], label="server + workers")
    ax1.plot(t, [s["server_rss_mb"] for s in result["samples"]], label="server process")
    ax1.set_ylabel("VmRSS (MB)")
    ax1.legend(loc="lower right")
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
    write_results(result, a.out, plot, dtype=result["figures"]["dtype"])
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
