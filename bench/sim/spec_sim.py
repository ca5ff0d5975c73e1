"""``baton bench spec`` on the simulated accelerator: the same workloads at GPU speed.

The CPU runs of ``bench/offline/spec.py`` give, per prompt, the default model's greedy output with
speculative decoding off. Those outputs become the simulated device's traces (one trace file
per concurrency: in bfloat16 a prompt's output may depend on its batch), so on the simulator
every mode verifies its drafts against exactly what the model produced, and acceptance is
the model's own. Each mode then runs the same prompts on ``device="sim:<gpu>"`` with the
named model shape, with synchronous and with async scheduling (a row "<mode> (async)"; the
simulator's default is async), all measured in one run. Wall time is the real engine's host
work plus the simulated device's time.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.engine import LLM, SamplingParams
from baton.engine.executor.sim_traces import Trace, TraceBook

ASYNC = " (async)"
ASYNC_OFF = "off" + ASYNC


FIXED = "-fixed"


def spec_config(mode: str, num_speculative_tokens: int) -> dict[str, Any] | None:
    """The ``speculative_config`` of a benchmark mode: None for "off"; "<method>" drafts with
    the adaptive draft policy (the engine's default), "<method>-fixed" always up to
    ``num_speculative_tokens`` per request and step."""
    if mode == "off":
        return None
    method = mode.removesuffix(FIXED)
    return {
        "method": method,
        "num_speculative_tokens": num_speculative_tokens,
        "adaptive": not mode.endswith(FIXED),
    }


def sim_modes(modes: Sequence[str]) -> list[tuple[str, str, bool]]:
    """Each mode's simulated runs: (row label, drafting method or "off", async scheduling),
    every mode synchronous first, then every mode with async scheduling."""
    return [(m + ASYNC if a else m, m, a) for a in (False, True) for m in modes]


@dataclass(frozen=True)
class SimRun:
    """One workload's prompts at one concurrency, with the CPU run's greedy outputs."""

    workload: str
    concurrency: int
    prompts: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    params: SamplingParams


def trace_of(tokens: Sequence[int], finish_reason: str | None, eos_ids: set[int]) -> tuple:
    """A trace's output from a finished output: its tokens without a closing EOS (the
    simulated device samples EOS where a trace ends)."""
    out = tuple(tokens)
    if finish_reason == "stop" and out and out[-1] in eos_ids:
        out = out[:-1]
    return out


def write_trace_files(runs: Sequence[SimRun], directory: Path) -> dict[int, Path]:
    """One trace file per concurrency holding every workload's prompts and outputs there."""
    by_c: dict[int, list[Trace]] = {}
    for r in runs:
        traces = by_c.setdefault(r.concurrency, [])
        traces += [Trace(p, o) for p, o in zip(r.prompts, r.outputs, strict=True)]
    paths = {}
    for c, traces in by_c.items():
        paths[c] = directory / f"traces_c{c}.jsonl"
        TraceBook(traces).save(paths[c])
    return paths


def measure_sim(
    model: str | None,
    device: str,
    shape: str,
    runs: Sequence[SimRun],
    modes: Sequence[str],
    num_speculative_tokens: int,
    max_model_len: int,
) -> dict[str, Any]:
    """Runs every mode, synchronous and async, on the simulator; returns the result's "sim"
    part.

    Raises:
        RuntimeError: a run's tokens differ from the CPU run's (the traces), or a request
            failed: the simulator replays the traces, so either is an engine bug.
    """
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_trace_files(runs, Path(tmp))
        for label, method, async_on in sim_modes(modes):
            for c, path in sorted(paths.items()):
                spec = spec_config(method, num_speculative_tokens)
                llm = LLM(
                    model,
                    device=device,
                    sim_shape=shape,
                    sim_traces=str(path),
                    async_scheduling=async_on,
                    speculative_config=spec,
                    structured_drafts=False,
                    max_num_seqs=max(c, 1),
                    max_model_len=max_model_len,
                    enable_prefix_caching=False,
                    grammar_compile_timeout_s=120.0,
                )
                try:
                    for run in runs:
                        if run.concurrency == c:
                            rows.append(_measure(llm, run, label))
                finally:
                    llm.engine.shutdown()
    return {"measured": True, "device": device, "shape": shape, "rows": rows}


def _measure(llm: LLM, run: SimRun, mode: str) -> dict[str, Any]:
    prompts = [list(p) for p in run.prompts]
    llm.generate(prompts, run.params, use_tqdm=False)  # compiles the grammar, warms the host
    before = llm.stats()
    c = run.concurrency
    tokens: list[tuple[int, ...]] = []
    finish: list[str | None] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), c):
        outs = llm.generate(prompts[start : start + c], run.params, use_tqdm=False)
        tokens += [tuple(o.outputs[0].token_ids) for o in outs]
        finish += [o.outputs[0].finish_reason for o in outs]
    wall = time.perf_counter() - t0
    after = llm.stats()
    if "error" in finish:
        raise RuntimeError(f"sim {mode} {run.workload} c={c}: a request failed")
    eos = set(llm.engine.tokenizer.eos_token_ids)
    replayed = [trace_of(t, f, eos) for t, f in zip(tokens, finish, strict=True)]
    if replayed != list(run.outputs):
        raise RuntimeError(f"sim {mode} {run.workload} c={c}: tokens differ from the traces")
    return {
        "workload": run.workload,
        "mode": mode,
        "concurrency": c,
        "prompts": len(prompts),
        **step_figures(before, after, sum(len(t) for t in tokens), wall),
    }


def step_figures(
    before: dict[str, Any], after: dict[str, Any], out_tokens: int, wall: float
) -> dict[str, Any]:
    """A run's speed and drafting figures from ``llm.stats()`` before and after it."""
    steps = after["steps"] - before["steps"]
    drafted = after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "tok_per_s": out_tokens / wall if wall else None,
        "steps": steps,
        "tokens_per_step": out_tokens / steps if steps else None,
        "drafts_per_step": drafted / steps if steps else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }
