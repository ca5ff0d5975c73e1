"""Data parallel on Ray vs one engine: throughput, and what grammar affinity does for the
replicas' compile caches.

1. Throughput: ``--requests`` greedy requests (distinct prompts, ``--max-tokens`` tokens each,
   EOS ignored) kept ``--concurrency`` at a time, on the default model in its default dtype:
   one engine in this process on every core (``AsyncLLM``, what runs without Ray), then
   ``DataParallelLLM`` with one replica per core (one torch thread each) on a local Ray
   cluster. A warm-up of a few requests runs first on each. Output tokens per second.
2. Grammar affinity: ``--schemas`` schemas from the JSON-Schema test suite (the shared data,
   evenly spaced by file name among those a probe request on the single engine served
   without an error), each requested ``--repeats`` times in a shuffled order (fixed
   seed) at the same concurrency, ``--affinity-tokens`` tokens each, on two replicas with
   affinity on and then off (fresh replicas, empty caches each time). Reported: the replicas'
   compile-cache hit rate ((hits + joined compiles) / lookups, summed over replicas), grammars
   compiled, requests that failed, wall time.

    baton bench data_parallel [--concurrency 32] [--requests 64] [--max-tokens 64]
        [--schemas 50] [--repeats 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from baton.bench.common import add_common_args, write_results
from baton.bench.grammars.grammar import default_data_dir
from baton.bench.plotting import pyplot
from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import engine_config
from baton.engine.entrypoints.async_llm import AsyncLLM
from baton.engine.entrypoints.serving import ServingEngine
from baton.engine.sampling_params import SamplingParams
from baton.grammar.spec import StructuredOutputsParams

TOPICS = ("a lighthouse", "a mountain town", "the sea", "a library", "a train", "a garden")


async def _drive(
    engine: ServingEngine, jobs: list[tuple[str, SamplingParams]], concurrency: int
) -> tuple[int, int, float]:
    """Runs ``jobs`` keeping ``concurrency`` in flight; (output tokens, failures, seconds)."""
    gate = asyncio.Semaphore(concurrency)
    tokens = failures = 0

    async def one(prompt: str, params: SamplingParams) -> None:
        nonlocal tokens, failures
        async with gate:
            last = None
            try:
                stream = await engine.add_request(prompt, params)
                async for out in stream:
                    last = out
            except Exception:  # noqa: BLE001 - counted: a bench reports, it does not stop
                failures += 1
                return
            assert last is not None
            if any(c.finish_reason == "error" for c in last.outputs):
                failures += 1
            tokens += sum(len(c.token_ids) for c in last.outputs)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, sp) for p, sp in jobs))
    return tokens, failures, time.perf_counter() - t0


def throughput(
    engine: ServingEngine, requests: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """Output tok/s of ``requests`` greedy requests at ``concurrency`` (after a warm-up)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm = [(f"Warm-up {i}: tell me about {TOPICS[i]}.", sp) for i in range(4)]
    asyncio.run(_drive(engine, warm, 4))
    jobs = [
        (f"Request {i}: write about {TOPICS[i % len(TOPICS)]} in detail.", sp)
        for i in range(requests)
    ]
    tokens, failures, wall = asyncio.run(_drive(engine, jobs, concurrency))
    return {"output_tokens": tokens, "failures": failures, "wall_s": wall, "tok_s": tokens / wall}


def accepted_schemas(engine: ServingEngine, data: Path, count: int) -> list[tuple[str, Any]]:
    """``count`` JSON-Schema test suite schemas, evenly spaced by file name among those one
    request of ``engine`` serves without an error (refused or failed compiles left out, so
    the affinity runs measure caching, not failures)."""
    files = sorted((data / "json-schema-test-suite").glob("*.json"))
    cases = [(p.name, json.loads(p.read_text())["schema"]) for p in files]
    ok = [False] * len(cases)

    async def probe() -> None:
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with gate:
                spec = StructuredOutputsParams(json=cases[i][1])
                sp = SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=spec)
                last = None
                try:
                    async for out in await engine.add_request("Probe.", sp):
                        last = out
                except Exception:  # noqa: BLE001 - refused: left out
                    return
                ok[i] = last is not None and all(c.finish_reason != "error" for c in last.outputs)

        await asyncio.gather(*(one(i) for i in range(len(cases))))

    asyncio.run(probe())
    accepted = [c for c, good in zip(cases, ok, strict=True) if good]
    if len(accepted) < count:
        raise SystemExit(f"only {len(accepted)} test-suite schemas are served, need {count}")
    step = len(accepted) / count
    return [accepted[int(i * step)] for i in range(count)]


def affinity_run(
    engine: Any, schemas: list[tuple[str, Any]], repeats: int, concurrency: int, tokens: int
) -> dict[str, Any]:
    """The schema workload on a fresh ``DataParallelLLM``; its replicas' cache counters."""
    rng = random.Random(0)
    order = [i for i in range(len(schemas)) for _ in range(repeats)]
    rng.shuffle(order)
    jobs = []
    for k, i in enumerate(order):
        spec = StructuredOutputsParams(json=schemas[i][1])
        jobs.append(
            (
                f"Request {k}: an instance of the schema, as JSON.",
                SamplingParams(max_tokens=tokens, temperature=0.0, structured_outputs=spec),
            )
        )
    _, failures, wall = asyncio.run(_drive(engine, jobs, concurrency))
    time.sleep(1.5)  # the replicas' counters are polled every half second
    stats = engine.stats()
    hits = float(stats.get("grammar_cache_hits", 0)) + float(stats.get("grammar_compile_joined", 0))
    misses = float(stats.get("grammar_cache_misses", 0))
    return {
        "requests": len(jobs),
        "failures": failures,
        "wall_s": wall,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "cache_misses": misses,
        "grammars_compiled": [r["grammar_compiles"] for r in engine.replica_stats()],
        "routed": [r["routed"] for r in engine.replica_stats()],
        "affinity": {k: stats.get(f"dp_affinity_{k}", 0) for k in ("hit", "miss", "new")},
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    rows = result["throughput"]
    a.bar([r["label"] for r in rows], [r["tok_s"] for r in rows], color="tab:blue")
    a.set_ylabel("output tok/s")
    a.set_title(f"concurrency {result['config']['concurrency']}, default model", fontsize=9)
    a.tick_params(axis="x", labelsize=7)
    rows = result["affinity"]
    b.bar([r["label"] for r in rows], [100 * r["cache_hit_rate"] for r in rows], color="tab:green")
    b.set_ylabel("grammar cache hit rate (%)")
    b.set_title(
        f"{result['config']['schemas']} schemas x {result['config']['repeats']}, 2 replicas",
        fontsize=9,
    )
    b.set_ylim(0, 100)
    fig.suptitle("Data parallel on Ray (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    """Returns the parser of ``baton bench data_parallel``'s options."""
    parser = argparse.ArgumentParser(prog="baton bench data_parallel", description=__doc__)
    add_common_args(parser, "data_parallel", model=False, dtype=None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--affinity-tokens", type=int, default=8)
    parser.add_argument("--data", type=Path, default=None, help="shared data folder")
    return parser


def _affinity_rows(
    config: EngineConfig, schemas: list[tuple[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Runs the schema workload on two fresh replicas with grammar affinity on, then off
    (printing a line each; Ray must be running); returns a row per run."""
    from baton.engine.entrypoints.data_parallel import DataParallelLLM
    from baton.engine.entrypoints.dp_config import DataParallelConfig

    affinity_rows = []
    for affinity in (True, False):
        dp = DataParallelLLM(
            config,
            DataParallelConfig(size=2, cpus_per_replica=1, grammar_affinity=affinity),
        )
        try:
            r = affinity_run(dp, schemas, args.repeats, args.concurrency, args.affinity_tokens)
        finally:
            dp.shutdown()
        label = "affinity on" if affinity else "affinity off (load only)"
        affinity_rows.append({"label": label, **r})
        print(
            f"{label}: cache hit rate {100 * r['cache_hit_rate']:.1f}%, compiled "
            f"{r['grammars_compiled']}, {r['failures']} failed, {r['wall_s']:.1f} s"
        )
    return affinity_rows


def main(argv: list[str] | None = None) -> int:
    """Runs both parts (one engine, then data parallel on a local Ray cluster), prints a line
    per run and writes ``--out`` (JSON) and its PNG; exits with a message without Ray."""
    args = _parser().parse_args(argv)
    try:
        import ray
    except ImportError:
        raise SystemExit("this benchmark needs Ray: pip install 'baton[ray]'") from None
    from baton.engine.entrypoints.data_parallel import DataParallelLLM
    from baton.engine.entrypoints.dp_config import DataParallelConfig

    cores = os.cpu_count() or 1
    config = engine_config(None, max_model_len=1024, enable_prefix_caching=False)
    rows = []
    # Before Ray starts: a Ray driver's torch may be held to one thread.
    threads = torch.get_num_threads()
    one = AsyncLLM(config)
    try:
        row = throughput(one, args.requests, args.concurrency, args.max_tokens)
        schemas = accepted_schemas(one, args.data or default_data_dir(), args.schemas)
    finally:
        one.shutdown()
    rows.append({"label": f"1 engine, {threads} threads", "replicas": 1, "threads": threads, **row})
    print(f"{rows[-1]['label']}: {row['tok_s']:.1f} tok/s ({row['failures']} failed)")
    ray.init(num_cpus=cores, include_dashboard=False, object_store_memory=256 << 20)
    try:
        dp = DataParallelLLM(config, DataParallelConfig(size=cores, cpus_per_replica=1))
        try:
            row = throughput(dp, args.requests, args.concurrency, args.max_tokens)
        finally:
            dp.shutdown()
        rows.append(
            {
                "label": f"DP={cores} on Ray, 1 thread each",
                "replicas": cores,
                "threads": 1,
                **row,
            }
        )
        print(f"{rows[-1]['label']}: {row['tok_s']:.1f} tok/s ({row['failures']} failed)")
        affinity_rows = _affinity_rows(config, schemas, args)
    finally:
        ray.shutdown()
    result = {
        "config": {
            "concurrency": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "schemas": args.schemas,
            "repeats": args.repeats,
            "affinity_tokens": args.affinity_tokens,
            "dtype": "auto",
        },
        "throughput": rows,
        "affinity": affinity_rows,
    }
    write_results(result, args.out, plot, torch_threads=threads)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
