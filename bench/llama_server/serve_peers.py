"""baton serve against llama.cpp's llama-server over HTTP: the same GGUF file, the same chat
prompts, the same JSON schema (through each server's OpenAI ``response_format``), the same
streaming clients, 2 threads each.

Each engine is one server process, started, warmed up (the schema compiled, first calls paid),
left idle for ``--settle`` seconds (baton-gguf moves its weights onto huge pages in idle time,
``engine/worker/weight_pages.py``: a server in service has long finished; every engine gets the
same pause), then measured: free requests (greedy, EOS ignored, ``--free-tokens``) and
JSON-schema requests (greedy, at most ``--json-tokens``) at each concurrency in turn. Per cell:
output tok/s, valid JSON objects per second and the valid share, TTFT p50/p99, TPOT p50. Per
engine: the load time (start to a healthy ``/health``), the peak proportional set size of its
process tree (PSS: pages shared between its processes counted once), the KV cache it reserved
and, for llama-server, the CPU variant it loaded. Then baton / llama-server per cell.

Engines: ``baton`` (its defaults), ``baton-gguf`` (``--quantization gguf``: the file's blocks
kept) and ``llama-server`` (built by ``baton.bench.llama_server.llama_cpp_build`` when missing,
``--parallel`` = the highest concurrency). Models: ``--model PATH`` or ``--shape llama-1b``
(a random-weight GGUF of that shape, ``baton.bench.llama_server.gguf_models``; ``--type Q4_K_M``).

As on an AVX2-only CPU, on an AVX-512 machine: ``--llama-variant haswell`` (llama-server with
its AVX2 kernels only) and baton under ``make test-avx2-only``'s limits, ``PYTHONPATH=
tests/avx2_only ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (its C++ kernels take their
AVX2 paths, ``auto`` picks float32); the result records both (``config``, ``isa_limits``).
It shows the instruction sets' share, not such a CPU's bandwidth or clock.

    baton bench serve_peers [--model PATH | --shape llama-1b --type Q4_K_M]
        [--engines baton,baton-gguf,llama-server] [--concurrency 1,8,16]
        [--llama-variant haswell]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from baton.bench.common import (
    add_common_args,
    config_from_args,
    csv_of,
    require_positive_ints,
    write_results,
)
from baton.bench.llama_server.gguf_models import SHAPES
from baton.bench.llama_server.serve_peers_report import plot, print_report, ratios
from baton.bench.serving.serve import LevelRun, ServeBenchConfig, percentile, run_level, warm_up
from baton.bench.serving.server_process import ServerProcess, free_port, sigterm_as_exit
from baton.engine.config import EngineConfig

ENGINES = ("baton", "baton-gguf", "llama-server")
MODES = ("free", "json")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ServePeersConfig:
    """What one comparison runs; raises ``ValueError`` naming a bad field."""

    engines: tuple[str, ...] = ENGINES
    concurrency: tuple[int, ...] = (1, 8, 16)
    free_tokens: int = 64
    json_tokens: int = 256
    min_requests: int = 4
    time_limit_s: float = 120.0
    threads: int = 2
    startup_timeout_s: float = 900.0
    settle_s: float = 10.0
    # llama-server limited to this CPU variant of its build (``LlamaCppBuild.one_variant``).
    llama_variant: str | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown or not self.engines:
            raise ValueError(f"engines must be among {list(ENGINES)}, got {list(self.engines)}")
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive ints, got {list(self.concurrency)}")
        require_positive_ints(self, "free_tokens", "json_tokens", "min_requests", "threads")
        if self.free_tokens < 2 or self.json_tokens < 2:
            raise ValueError("free_tokens and json_tokens must be >= 2 (TPOT needs two tokens)")
        if not self.settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0 seconds, got {self.settle_s}")

    def cell(self, mode: str, concurrency: int) -> ServeBenchConfig:
        """The load test of one cell: every request free or every one JSON."""
        return ServeBenchConfig(
            concurrency=(concurrency,),
            requests=max(self.min_requests, concurrency),
            time_limit_s=self.time_limit_s,
            json_fraction=1.0 if mode == "json" else 0.0,
            max_tokens=self.json_tokens if mode == "json" else self.free_tokens,
            startup_timeout_s=self.startup_timeout_s,
        )


# ------------------------------------------------------------------ memory
def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue  # exited meanwhile
    return out


def tree_pss_bytes(pid: int) -> int:
    """The proportional set size of ``pid``'s process tree (0 for processes gone)."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


class PeakSampler:
    """Samples a process tree's PSS every ``interval_s`` on a thread; ``peak`` is the highest.
    (Reading smaps_rollup of a multi-GiB process costs CPU time: at 0.25 s the sampler took a
    fifth of a core beside the server it measured.)

    A context manager: entering starts the thread, leaving stops it.
    """

    def __init__(self, pid: int, interval_s: float = 2.0) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------ servers
def server_for(engine: str, model: Path, cfg: ServePeersConfig) -> ServerProcess:
    """The (not yet started) server of ``engine`` on ``model``."""
    if engine.startswith("baton"):
        # A fixed thread count, as llama-server's -t: baton otherwise lowers its threads while
        # other processes keep the CPUs busy (adapt_cpu_threads), and the CPUs it may use set it.
        args = ["--no-adapt-cpu-threads"]
        args += ["--quantization", "gguf"] if engine == "baton-gguf" else []
        server = ServerProcess(str(model), dtype="auto", server_args=args)
        server.command = ["taskset", "-c", f"0-{cfg.threads - 1}", *server.command]
        return server
    from baton.bench.llama_server.llama_cpp_build import build

    parallel = max(cfg.concurrency)
    port = free_port()
    program = build().server
    if cfg.llama_variant:
        program = build().one_variant(cfg.llama_variant)
    command = [str(program), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-t", str(cfg.threads), "-tb", str(cfg.threads), "--parallel", str(parallel)]
    # Each slot holds its prompt (~100 tokens) and its longest answer.
    # -lv 4: the log names the CPU variant loaded and the KV buffer reserved.
    command += ["-c", str(parallel * (cfg.json_tokens + 256)), "--no-webui", "-lv", "4"]
    return ServerProcess(None, port=port, command=command, name="llama-server")


def kv_cache_bytes(engine: str, log: str) -> int | None:
    """The KV cache the server reserved: baton's configured size, llama-server's from its log."""
    if engine.startswith("baton"):
        return EngineConfig().kv_cache_memory_bytes
    sizes = re.findall(r"KV buffer size\s*=\s*([\d.]+) MiB", log)
    return int(sum(float(s) for s in sizes) * 2**20) if sizes else None


def summarize(run: LevelRun, mode: str) -> dict[str, Any]:
    """One cell: counts, throughput, valid objects and the client-side percentiles."""
    ok = [r for r in run.records if r.error is None]
    valid = sum(1 for r in ok if r.json_valid)
    checked = sum(1 for r in ok if r.structured)
    tokens = sum(r.output_tokens or 0 for r in ok)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    errors = sorted({r.error for r in run.records if r.error is not None})
    return {
        "mode": mode,
        "concurrency": run.concurrency,
        "issued": len(run.records),
        "done": len(ok),
        "errors": errors[:3],
        "seconds": run.seconds,
        "output_tokens": tokens,
        "tok_per_s": tokens / run.seconds,
        "objects_per_s": valid / run.seconds if mode == "json" else None,
        # Of the JSON requests, those whose text parses and validates (cut ones count invalid).
        "valid_share": valid / checked if checked else None,
        "length_cut": sum(1 for r in ok if r.finish_reason == "length") if mode == "json" else 0,
        "ttft_p50_ms": ms(percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50)),
        "ttft_p99_ms": ms(percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99)),
        "tpot_p50_ms": ms(percentile([r.tpot_s for r in ok if r.tpot_s is not None], 50)),
    }


async def _measure(base: str, cfg: ServePeersConfig) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4)
    timeout = httpx.Timeout(900.0, connect=30.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
        prompt = await warm_up(client, model, 0, cfg.free_tokens)
        await asyncio.sleep(cfg.settle_s)
        cells = []
        for mode in MODES:
            for conc in cfg.concurrency:
                cell = cfg.cell(mode, conc)
                run = await run_level(client, model, cell, conc, prompt)
                prompt += run.planned
                cells.append(summarize(run, mode))
                print(f"  {mode} c{conc}: {cells[-1]}", flush=True)
    return cells


def run_engine(engine: str, model: Path, cfg: ServePeersConfig) -> dict[str, Any]:
    """One engine's server: started, measured, stopped (whatever happens).

    Raises:
        RuntimeError: the server did not start or could not serve the warm-up.
    """
    from baton.bench.llama_server.llama_cpp_build import loaded_variant

    server = server_for(engine, model, cfg)
    with server:
        assert server.pid is not None
        with PeakSampler(server.pid) as sampler:
            load_s = server.wait_healthy(cfg.startup_timeout_s)
            pss_loaded = tree_pss_bytes(server.pid)
            log = server.log_tail(1_000_000)  # now: the load's lines, before requests add more
            cells = asyncio.run(_measure(server.base, cfg))
    return {
        "engine": engine,
        "command": server.command,
        "load_s": load_s,
        "pss_after_load_mib": pss_loaded / 2**20,
        "peak_pss_mib": sampler.peak / 2**20,
        "kv_cache_mib": (kv_cache_bytes(engine, log) or 0) / 2**20,
        "cpu_variant": loaded_variant(log) if engine == "llama-server" else None,
        "cells": cells,
    }


def run(cfg: ServePeersConfig, model: Path) -> dict[str, Any]:
    """Every engine of ``cfg`` on ``model``, one after another; the results and the ratios."""
    engines, load_start = [], os.getloadavg()[0]
    for engine in cfg.engines:
        print(f"{engine} on {model.name}", flush=True)
        engines.append(run_engine(engine, model, cfg))
    return {
        "model": str(model),
        "model_file_mib": model.stat().st_size / 2**20,
        "config": asdict(cfg),
        "engines": engines,
        "ratios": ratios(engines),
        "load_avg": [load_start, os.getloadavg()[0]],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the comparison, prints its table and writes ``--out`` (JSON) and its PNG."""
    p = argparse.ArgumentParser(prog="baton bench serve_peers", description=__doc__)
    add_common_args(p, "serve_peers", dtype=None)
    p.add_argument(
        "--shape", default=None, choices=sorted(SHAPES), help="a random-weight GGUF of a shape"
    )
    p.add_argument("--type", dest="qtype", default="Q4_K_M", help="its quantisation (--shape)")
    p.add_argument("--engines", type=csv_of(str), default=ENGINES)
    p.add_argument("--concurrency", type=csv_of(int), default=(1, 8, 16))
    p.add_argument("--free-tokens", type=int, default=64)
    p.add_argument("--json-tokens", type=int, default=256)
    p.add_argument("--min-requests", type=int, default=4, help="per cell (at least concurrency)")
    p.add_argument(
        "--time-limit", type=float, dest="time_limit_s", default=120.0, help="seconds per cell"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--settle",
        type=float,
        dest="settle_s",
        default=10.0,
        help="idle seconds between the warm-up and the first cell (default 10)",
    )
    p.add_argument(
        "--llama-variant",
        default=None,
        help="limit llama-server to one CPU variant of its build (haswell: AVX2 only)",
    )
    a = p.parse_args(argv)
    cfg = config_from_args(p, a, ServePeersConfig)  # a bad value: a usage error
    if a.shape is not None:
        from baton.bench.llama_server.gguf_models import quantized_model

        model = quantized_model(a.shape, a.qtype)
    else:
        from baton.engine.loader import default_model_path

        model = Path(a.model) if a.model else default_model_path()
    t0 = time.perf_counter()
    with sigterm_as_exit():
        result = run(cfg, model)
    result["wall_s"] = time.perf_counter() - t0
    print_report(result)
    write_results(result, a.out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
