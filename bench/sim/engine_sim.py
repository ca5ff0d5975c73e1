"""Engine benchmark on the simulated accelerator: async vs sync scheduling at GPU speed.

``baton bench engine --device sim:h200 --shape llama-3.1-8b`` runs the real engine (scheduler,
AsyncScheduler, grammar compile/fill/accept, detokeniser, output processing) against a
simulated device that spends no host CPU (``engine/executor/sim.py``): each step takes the
time a roofline gives for its work on the named GPU and model shape, and tokens come from
traces (greedy outputs of the default model; valid instances of the shared schemas, whose
every token the device checks against the engine's bitmask). So the ratios it reports are
about the host engine: how well it keeps an accelerator busy.

For each batch size one engine with async scheduling and one without are built, their
grammars compiled, then each runs ``waves x batch`` requests (``max_num_seqs = batch``, so the
batch stays full while requests finish and new ones start) for each share of JSON-schema
requests. Free requests get the same lengths as the JSON ones. Steady figures are taken over
the steps that run the full batch. Every JSON output is validated against its schema.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema

from baton.bench import common
from baton.bench.common import RESULTS_DIR, judge_goal, write_results
from baton.bench.grammars.grammar import default_data_dir
from baton.bench.sim.engine_sim_report import mode_label, plot, print_report, timeline_path
from baton.bench.sim.sim_traces import (
    JsonCase,
    chat_prompt,
    free_prompts,
    json_cases,
    json_prompt,
    record_free_traces,
)
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.core.stats import PHASES, Span
from baton.engine.executor.sim import DeviceOp, SimExecutor
from baton.engine.executor.sim_traces import Trace, TraceBook
from baton.engine.loader import load_tokenizer
from baton.engine.sim_specs import GPUS, SHAPES
from baton.engine.tokenizer import Tokenizer

DATA_DIR = default_data_dir()
FREE_TRACES = 64  # recorded greedy outputs, reused across requests with distinct prompts
TIMELINE_STEPS = 6

# Goals (targets, not measurements).
IDLE_TARGET = 0.05
IDLE_BATCHES = (16, 64, 256)
ASYNC_TARGET = 1.3
STRUCTURED_TARGET = 0.95
GOAL_BATCH = 64


@dataclass(frozen=True)
class SimBenchConfig:
    """What one run measures; raises ``ValueError`` naming a bad field."""

    device: str = "sim:h200"
    shape: str = "llama-3.1-8b"
    batches: tuple[int, ...] = (1, 16, 64, 256)
    json_fractions: tuple[float, ...] = (0.0, 0.5, 1.0)
    waves: int = 3
    schemas: int = 48
    min_json_tokens: int = 48
    max_json_tokens: int = 256
    model: str | None = None  # the tokenizer (and the free traces' model)
    data_dir: Path = DATA_DIR

    def __post_init__(self) -> None:
        if not self.device.startswith("sim:") or self.device[4:] not in GPUS:
            raise ValueError(f"device must be sim:<gpu> with gpu in {sorted(GPUS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {self.shape!r}")
        if not self.batches or any(b <= 0 for b in self.batches):
            raise ValueError(f"batches must be positive ints, got {list(self.batches)}")
        if not self.json_fractions or any(not 0 <= f <= 1 for f in self.json_fractions):
            raise ValueError(f"json fractions must lie in [0, 1], got {list(self.json_fractions)}")
        if self.waves < 1 or self.schemas < 1:
            raise ValueError("waves and schemas must be >= 1")
        if not 1 <= self.min_json_tokens <= self.max_json_tokens:
            raise ValueError("need 1 <= min_json_tokens <= max_json_tokens")
        if not (self.data_dir / "schemastore").is_dir():
            raise ValueError(f"{self.data_dir} has no schemastore/ (the shared schemas)")


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: SamplingParams
    schema: dict[str, Any] | None


def build_requests(
    tokenizer: Tokenizer,
    cases: Sequence[JsonCase],
    free: Sequence[Trace],
    n: int,
    fraction: float,
) -> tuple[list[Request], list[Trace]]:
    """``n`` requests, JSON wherever the running share falls short of ``fraction`` (so mixed
    batches mix all along), and the traces they replay. Request ``j`` has the length of JSON
    case ``j`` whether it is JSON or free; every prompt is distinct."""
    requests, traces = [], []
    n_json = 0
    for j in range(n):
        case = cases[j % len(cases)]
        if n_json < round((j + 1) * fraction):
            n_json += 1
            prompt = json_prompt(tokenizer, case.name, j)
            spec = StructuredOutputsParams(json=case.schema)
            # The trace's EOS ends it; max_tokens only bounds it.
            sp = SamplingParams(
                max_tokens=len(case.output) + 1, temperature=0.0, structured_outputs=spec
            )
            requests.append(Request(prompt, sp, case.schema))
            traces.append(Trace(prompt, case.output))
        else:
            prompt = chat_prompt(tokenizer, f"Go on with story #{j % len(free)} (request #{j}).")
            sp = SamplingParams(max_tokens=len(case.output), temperature=0.0)
            requests.append(Request(prompt, sp, None))
            traces.append(Trace(prompt, free[j % len(free)].output))
    return requests, traces


# ---------------------------------------------------------------- measuring
def _window(ops: Sequence[DeviceOp], batch: int) -> tuple[float, float, int] | None:
    """(start, end, steps) of the steady window: from the first to the last forward that runs
    the full batch, through that step's sampling."""
    full = [o for o in ops if o.kind == "forward" and o.num_requests == batch]
    if not full:
        return None
    first, last = full[0], full[-1]
    end = max(
        (o.end for o in ops if o.kind == "sample" and o.step_id == last.step_id), default=last.end
    )
    steps = sum(1 for o in ops if o.kind == "forward" and first.start <= o.start <= last.start)
    return first.start, end, steps


def _busy(ops: Sequence[DeviceOp], start: float, end: float) -> float:
    return sum(max(0.0, min(o.end, end) - max(o.start, start)) for o in ops)


def run_case(llm: LLM, requests: Sequence[Request], batch: int) -> dict[str, Any]:
    """Runs ``requests`` to the end and measures the run and its steady window."""
    executor = llm.engine.core.executor
    assert isinstance(executor, SimExecutor)
    stats = llm.engine.core.stats
    before, host0, late0 = llm.stats(), executor.host_seconds, executor.wake_late_seconds
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(
        [list(r.prompt) for r in requests], [r.params for r in requests], use_tqdm=False
    )
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = llm.stats()
    ops = [o for o in executor.device_ops() if o.start >= t0]
    spans = stats.recent_spans(since=t0)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    checked = invalid = errors = 0
    for out, req in zip(outs, requests, strict=True):
        c = out.outputs[0]
        errors += c.finish_reason == "error"
        if req.schema is not None:
            checked += 1
            try:
                jsonschema.validate(json.loads(c.text), req.schema)
            except (json.JSONDecodeError, jsonschema.ValidationError):
                invalid += 1
    async_on = bool(llm.config.async_scheduling)
    row: dict[str, Any] = {
        "async": async_on,
        # Async only: a deferred step's fill on the fill thread (False: on the engine thread).
        "fill_thread": llm.config.grammar_fill_thread if async_on else None,
        "batch": batch,
        "requests": len(requests),
        "seconds": seconds,
        "output_tokens": tokens,
        "tok_per_s": tokens / seconds,
        "steps": int(after["steps"] - before["steps"]),
        "deferred_steps": int(after["deferred_steps"] - before["deferred_steps"]),
        "sim_host_ms_per_step": None,
        "json_checked": checked,
        "json_invalid": invalid,
        "errors": errors,
    }
    steps = max(1, row["steps"])
    row["sim_host_ms_per_step"] = (executor.host_seconds - host0) / steps * 1e3
    # The whole run's CPU time, every thread of the process (engine, fill thread, simulator):
    # against the cores' capacity it tells a host short of cores from one whose engine thread
    # is the bottleneck while the other core idles.
    row["cpu_ms_per_step"] = cpu / steps * 1e3
    row["cores_busy"] = cpu / seconds
    # The OS waking the engine thread late after a device wait (not engine work).
    row["wake_late_ms_per_step"] = (executor.wake_late_seconds - late0) / steps * 1e3
    window = _window(ops, batch)
    if window is None:
        return row
    start, end, n = window
    in_window = [s for s in spans if start <= s.start < end]
    phases = {p: sum(s.end - s.start for s in in_window if s.phase == p) / n * 1e3 for p in PHASES}
    host_ms = sum(v for p, v in phases.items() if p != "wait")
    sampled = sum(o.num_sampled for o in ops if o.kind == "sample" and start <= o.start < end)
    device_ms = _busy(ops, start, end) / n * 1e3
    row.update(
        steady_steps=n,
        steady_idle=1.0 - _busy(ops, start, end) / (end - start),
        steady_tok_per_s=sampled / (end - start),
        step_ms=(end - start) / n * 1e3,
        device_ms_per_step=device_ms,
        host_ms_per_step=host_ms,
        host_us_per_request_step=host_ms / batch * 1e3,
        phase_ms_per_step=phases,
    )
    return row


def timeline(llm: LLM, t0: float, batch: int) -> dict[str, Any] | None:
    """Host spans and device ops of ``TIMELINE_STEPS`` steady steps from the middle of the
    last run (times in ms from the first of them)."""
    executor = llm.engine.core.executor
    assert isinstance(executor, SimExecutor)
    ops = [o for o in executor.device_ops() if o.start >= t0]
    full = [o for o in ops if o.kind == "forward" and o.num_requests == batch]
    if len(full) < TIMELINE_STEPS + 2:
        return None
    mid = len(full) // 2
    start, end = full[mid].start, full[mid + TIMELINE_STEPS].start
    recent = llm.engine.core.stats.recent_spans(since=start)
    spans: list[Span] = [s for s in recent if s.start < end]
    return {
        "device": [
            {
                "kind": o.kind,
                "step": o.step_id,
                "start": (o.start - start) * 1e3,
                "end": (o.end - start) * 1e3,
            }
            for o in ops
            if o.end > start and o.start < end
        ],
        "host": [
            {
                "phase": s.phase,
                "step": s.step_id,
                "start": (s.start - start) * 1e3,
                "end": (s.end - start) * 1e3,
            }
            for s in spans
        ],
    }


# ------------------------------------------------------------------ running
# The engines of a batch: async, sync, and async with each deferred fill on the engine
# thread (the fill thread's share of async's gain; only where there is JSON).
MODES = ("async", "sync", "async, fill on engine thread")


def build_llm(cfg: SimBenchConfig, mode: str, batch: int, traces: Path) -> LLM:
    return LLM(
        cfg.model,
        device=cfg.device,
        sim_shape=cfg.shape,
        sim_traces=str(traces),
        async_scheduling=mode != "sync",
        grammar_fill_thread=mode == "async",
        # Async vs sync like for like, without drafts (bench/offline/spec.py measures those).
        structured_drafts=False,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, 8 * batch),
        grammar_compile_timeout_s=120.0,
    )


def run(cfg: SimBenchConfig) -> dict[str, Any]:
    """Builds the traces, runs every case and returns the result (rows, ratios, goals,
    timelines); prints one line per case as it goes."""
    load_start = os.getloadavg()[0]
    tok = load_tokenizer(cfg.model)
    t0 = time.perf_counter()
    cases = json_cases(tok, cfg.data_dir, cfg.schemas, cfg.min_json_tokens, cfg.max_json_tokens)
    if not cases:
        raise SystemExit("no shared schema instance passed the filters")
    print(f"{len(cases)} JSON cases in {time.perf_counter() - t0:.0f} s")
    free = record_free_traces(free_prompts(tok, FREE_TRACES), cfg.max_json_tokens, cfg.model)
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in cfg.batches:
            n = max(8, cfg.waves * batch)
            workloads = {f: build_requests(tok, cases, free, n, f) for f in cfg.json_fractions}
            book = TraceBook([t for _, traces in workloads.values() for t in traces])
            path = Path(tmp) / f"traces-{batch}.jsonl"
            book.save(path)
            llms = {mode: build_llm(cfg, mode, batch, path) for mode in MODES}
            try:
                warm = workloads[max(cfg.json_fractions)][0][: len(cases)]
                for llm in llms.values():  # compile every grammar before measuring
                    llm.generate(
                        [list(r.prompt) for r in warm],
                        [
                            SamplingParams(
                                max_tokens=1, structured_outputs=r.params.structured_outputs
                            )
                            for r in warm
                        ],
                        use_tqdm=False,
                    )
                for i, fraction in enumerate(cfg.json_fractions):
                    requests = workloads[fraction][0]
                    modes = MODES if fraction > 0 else MODES[:2]
                    for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                        t_run = time.perf_counter()
                        row = run_case(llms[mode], requests, batch)
                        row["json_fraction"] = fraction
                        rows.append(row)
                        print(_line(row))
                        last = fraction == max(cfg.json_fractions)
                        if mode in ("async", "sync") and batch == GOAL_BATCH and last:
                            timelines[mode] = timeline(llms[mode], t_run, batch)
            finally:
                for llm in llms.values():
                    llm.shutdown()
    ratios = compute_ratios(rows)
    return {
        "device": cfg.device,
        "gpu": asdict(GPUS[cfg.device[4:]]),
        "shape": asdict(SHAPES[cfg.shape]),
        "tokenizer": cfg.model or "default model (SmolLM2-135M-Instruct)",
        "batches": list(cfg.batches),
        "json_fractions": list(cfg.json_fractions),
        "waves": cfg.waves,
        "json_cases": [{"schema": c.name, "tokens": len(c.output)} for c in cases],
        "free_traces": {"count": len(free), "model": cfg.model or "default", "dtype": "bfloat16"},
        "rows": rows,
        "ratios": ratios,
        "goals": evaluate_goals(rows, ratios),
        "timeline": {"batch": GOAL_BATCH, "json_fraction": max(cfg.json_fractions), **timelines},
        "load": (
            f"1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at "
            f"the end, on {os.cpu_count()} cores"
        ),
    }


def _line(r: dict[str, Any]) -> str:
    idle = r.get("steady_idle")
    host = r.get("host_us_per_request_step")
    return (
        f"batch {r['batch']:>4} json {r['json_fraction']:.0%} "
        f"async {mode_label(r)}: "
        f"{r['tok_per_s']:8.0f} tok/s, idle {'-' if idle is None else f'{idle:.1%}'}, "
        f"host {'-' if host is None else f'{host:.1f}'} us/request-step, "
        f"errors {r['errors']}, invalid JSON {r['json_invalid']}/{r['json_checked']}"
    )


# ------------------------------------------------------------- ratios, goals
def _find(rows: list[dict[str, Any]], **key: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in key.items())), None)


def _is_async(row: dict[str, Any]) -> bool:
    """Async with the default fill thread (results from before the flag have no key)."""
    return row["async"] and row.get("fill_thread", True)


def compute_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch, JSON share): async/sync throughput, async with the fill thread over async
    with each fill on the engine thread; per batch: structured/free with async."""
    out = []
    for r in rows:
        if not _is_async(r):
            continue
        case = {"batch": r["batch"], "json_fraction": r["json_fraction"]}
        sync = _find(rows, **case, **{"async": False})
        free = next(
            (
                x
                for x in rows
                if _is_async(x) and x["batch"] == r["batch"] and x["json_fraction"] == 0.0
            ),
            None,
        )
        on_engine = _find(rows, **case, **{"async": True, "fill_thread": False})
        out.append(
            {
                **case,
                "async_over_sync": r["tok_per_s"] / sync["tok_per_s"] if sync else None,
                "structured_over_free": r["tok_per_s"] / free["tok_per_s"] if free else None,
                "fill_thread_gain": r["tok_per_s"] / on_engine["tok_per_s"] if on_engine else None,
            }
        )
    return out


def evaluate_goals(
    rows: list[dict[str, Any]], ratios: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    idle = {
        f"b={r['batch']} json={r['json_fraction']:g}": r.get("steady_idle")
        for r in rows
        if _is_async(r) and r["batch"] in IDLE_BATCHES and r["json_fraction"] in (0.0, 1.0)
    }
    speed = {
        f"json={x['json_fraction']:g}": x["async_over_sync"]
        for x in ratios
        if x["batch"] == GOAL_BATCH and x["json_fraction"] in (0.0, 1.0)
    }
    structured = {
        f"json={x['json_fraction']:g}": x["structured_over_free"]
        for x in ratios
        if x["batch"] == GOAL_BATCH and x["json_fraction"] == 1.0
    }
    return [
        judge_goal(
            "device idle in steady decode, async, batch 16/64/256, 0% and 100% JSON",
            f"<= {IDLE_TARGET:.0%}",
            idle,
            "max",
            IDLE_TARGET,
        ),
        judge_goal(
            f"async/sync throughput, batch {GOAL_BATCH}, 0% and 100% JSON",
            f">= {ASYNC_TARGET}",
            speed,
            "min",
            ASYNC_TARGET,
        ),
        judge_goal(
            f"structured/free throughput with async, batch {GOAL_BATCH}",
            f">= {STRUCTURED_TARGET}",
            structured,
            "min",
            STRUCTURED_TARGET,
        ),
    ]


def add_sim_args(p: argparse.ArgumentParser) -> None:
    """The simulated-device options of ``baton bench engine``."""
    p.add_argument("--shape", default="llama-3.1-8b", help=f"model shape: {', '.join(SHAPES)}")
    p.add_argument("--waves", type=int, default=3, help="requests per case = waves x batch")
    p.add_argument("--schemas", type=int, default=48, help="shared schemas (one instance each)")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR, help="the shared data folder")


def main_sim(parser: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Runs the simulated-device benchmark from ``baton bench engine``'s parsed options
    (``--device sim:<gpu>``); writes ``bench/results/engine_sim.json`` and its plots unless
    ``--out`` names another file. A bad option is the parser's usage error."""
    cfg = common.config_from_args(
        parser,
        a,
        SimBenchConfig,
        batches=a.batches or SimBenchConfig.batches,
        json_fractions=a.json_fractions or SimBenchConfig.json_fractions,
    )
    result = run(cfg)
    print_report(result)
    out = a.out if a.out != RESULTS_DIR / "engine.json" else RESULTS_DIR / "engine_sim.json"
    result["timeline_png"] = timeline_path(out).name
    write_results(result, out, plot, device=cfg.device, shape=cfg.shape)
    return 0
