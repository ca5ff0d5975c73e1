"""Where an engine step's time goes on a GPU: torch.profiler and cProfile over one batch.

A stage of the prepared GPU check (``bench/gpu/gpu_check.py``). For each case (async free decoding
with the decode CUDA graphs, async JSON with graphs, synchronous JSON with grammar drafts, and
async free decoding without graphs) it builds the engine as ``baton bench engine`` does, warms
it up, then runs one batch under ``torch.profiler`` (CPU and CUDA activities) and one under
``cProfile``, and writes ``<case>.txt`` with the wall time, the top operators by device and by
host time, and the top Python functions by cumulative time.

    python -m baton.bench.gpu.gpu_profile --out DIR [--model M] [--batch 32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import os
import pstats
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from baton.bench.offline.engine import WARMUP_TOKENS, build_llm, conversations, request_params
from baton.engine import LLM, SamplingParams
from baton.engine.loader import load_checkpoint
from baton.engine.worker.cuda_graphs import GRAPH_COPIES_ENV
from baton.engine.worker.host_times import RUNNER_TIMES_ENV

# name: (async scheduling, JSON share, enforce_eager, grammar fill thread: None = default,
# graphs per batch size)
CASES = {
    "async_free_graphs": (True, 0.0, False, None, 1),
    "async_json_graphs": (True, 1.0, False, None, 1),
    # Without the fill thread: whether the runner's host laps (the graph replay's among them:
    # 1.0 ms a step with JSON against 0.5 ms free at e6fd73d) grow from waiting for the GIL
    # the fill thread holds.
    "async_json_graphs_nofill": (True, 1.0, False, False, 1),
    # Two graphs per size replayed in turn: whether a replay waits for the previous run of
    # the same graph (engine/worker/cuda_graphs.py GRAPH_COPIES_ENV).
    "async_free_graphs_2copies": (True, 0.0, False, None, 2),
    "sync_json_drafts": (False, 1.0, False, None, 1),
    "async_free_eager": (True, 0.0, True, None, 1),
}


PHASES = ("schedule", "bitmask", "launch", "device_wait", "update", "output", "engine", "device")


def phase_ms_per_step(before: dict, after: dict) -> dict[str, float]:
    """The engine's phase times (``LLM.stats()``'s ``<phase>_s``) between two readings, in ms
    per engine step; ``engine`` is the whole step, ``device`` the device's own time."""
    steps = max(1, after.get("steps", 0) - before.get("steps", 0))
    return {k: 1e3 * (after.get(f"{k}_s", 0.0) - before.get(f"{k}_s", 0.0)) / steps for k in PHASES}


def runner_laps(llm: Any) -> dict[str, float]:
    """The in-process runner's host seconds per part so far (`HostTimes`); empty when the
    model runs in a worker process."""
    runner = getattr(getattr(llm.engine.core, "executor", None), "runner", None)
    return runner.host_times.snapshot() if runner is not None else {}


def _plain_run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, dict[str, float], dict[str, float]]:
    """Runs ``prompts`` without a profiler; returns the wall seconds, the engine's phase times
    and the runner's host laps, both in ms per engine step."""
    before, laps_before = llm.stats(), runner_laps(llm)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)  # no profiler: the engine's own phases
    plain_s = time.perf_counter() - t0
    after = llm.stats()
    phases = phase_ms_per_step(before, after)
    steps_plain = max(1, after.get("steps", 0) - before.get("steps", 0))
    laps = {
        k: 1e3 * (v - laps_before.get(k, 0.0)) / steps_plain for k, v in runner_laps(llm).items()
    }
    return plain_s, phases, laps


def _torch_profiled(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[profile, float, int, int]:
    """Runs ``prompts`` under ``torch.profiler`` (CPU and CUDA); returns the profiler, the
    wall seconds, the engine steps taken and the output tokens."""
    t0 = time.perf_counter()
    steps_before = llm.stats().get("steps", 0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params, use_tqdm=False)
    profiled_s = time.perf_counter() - t0
    profiled_steps = llm.stats().get("steps", 0) - steps_before
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return prof, profiled_s, profiled_steps, tokens


def _cprofiled(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[cProfile.Profile, float, int]:
    """Runs ``prompts`` under cProfile; returns the profile, the wall seconds and the engine
    steps taken."""
    steps_before = llm.stats().get("steps", 0)
    py = cProfile.Profile()
    t0 = time.perf_counter()
    py.enable()
    llm.generate(prompts, params, use_tqdm=False)
    py.disable()
    cprofile_s = time.perf_counter() - t0
    steps = llm.stats().get("steps", 0) - steps_before
    return py, cprofile_s, steps


def _export_trace(prof: profile, trace: Path) -> Path:
    """Writes the profiler's Chrome trace gzipped beside ``trace`` (``trace`` itself is not
    kept); returns the ``.gz`` file's path."""
    prof.export_chrome_trace(str(trace))
    packed_path = Path(f"{trace}.gz")
    with open(trace, "rb") as raw, gzip.open(packed_path, "wb") as packed:
        packed.writelines(raw)
    trace.unlink()
    return packed_path


def _gpu_totals(averages: Any) -> tuple[int, float]:
    """Returns the count of GPU events (kernels and copies, graph replays' kernels included)
    and the GPU's own time in microseconds, from the profiler's key averages."""
    on_gpu = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    events = sum(e.count for e in on_gpu)
    # What the GPU itself spent (kernels and copies), unlike the engine's event spans, which
    # also hold the gaps where the GPU waits for the host's launches.
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in on_gpu)
    return events, gpu_us


def _report_text(head: str, averages: Any, py: cProfile.Profile) -> str:
    """Returns a case's report: ``head``, the top operators by device and by host time, and
    the top Python functions by cumulative time."""
    stats_text = io.StringIO()
    pstats.Stats(py, stream=stats_text).sort_stats("cumulative").print_stats(45)
    return "\n\n".join(
        [
            head,
            "== operators by self device time ==",
            averages.table(sort_by="self_cuda_time_total", row_limit=30),
            "== operators by self host time ==",
            averages.table(sort_by="self_cpu_time_total", row_limit=30),
            "== Python functions by cumulative time (cProfile) ==",
            stats_text.getvalue(),
        ]
    )


def profile_case(
    name: str, model: str | None, batch: int, output_len: int, out: Path, device: str
) -> str:
    """Profiles one case; writes ``out/<name>.txt`` and returns its first line."""
    async_on, fraction, eager, fill_thread, copies = CASES[name]
    ckpt = load_checkpoint(model)
    tok = ckpt.tokenizer
    chats = conversations(1000, 4 * batch + 4)
    prompts = [list(tok.apply_chat_template(c, tokenize=True)) for c in chats]
    warm, runs = prompts[:4], [prompts[4 + i * batch : 4 + (i + 1) * batch] for i in range(4)]
    max_len = max(len(p) for p in prompts) + max(output_len, WARMUP_TOKENS) + 1
    os.environ[RUNNER_TIMES_ENV] = "1"  # the runner's own host laps (engine/worker/host_times.py)
    os.environ[GRAPH_COPIES_ENV] = str(copies)
    try:
        llm = build_llm(ckpt, async_on, batch, max_len, warm, device, None, eager, fill_thread)
    finally:
        os.environ.pop(GRAPH_COPIES_ENV, None)
    params = request_params(batch, fraction, output_len)
    try:
        llm.generate(runs[0], params, use_tqdm=False)  # warm at this batch size
        plain_s, phases, laps = _plain_run(llm, runs[3], params)
        prof, profiled_s, profiled_steps, tokens = _torch_profiled(llm, runs[1], params)
        py, cprofile_s, steps = _cprofiled(llm, runs[2], params)
    finally:
        llm.shutdown()
    # The timeline, gzipped: whether a replay's host call waits for the GPU (its
    # cudaGraphLaunch span against the previous graph's kernels) only shows on it.
    _export_trace(prof, out / f"{name}.trace.json")
    averages = prof.key_averages()
    # Kernels and copies on the GPU (graph replays' kernels included), per engine step.
    gpu_events, gpu_us = _gpu_totals(averages)
    head = (
        f"{name}: batch {batch}, {tokens} tokens in {profiled_s:.3f} s and {profiled_steps} steps "
        f"under torch.profiler ({gpu_events / max(profiled_steps, 1):.0f} GPU kernels and copies "
        f"per step, {gpu_us / 1e3 / max(profiled_steps, 1):.3f} ms of GPU time per step); "
        f"{cprofile_s:.3f} s and {steps} steps under cProfile; {plain_s:.3f} s without a "
        f"profiler, engine phases in ms per step: "
        + ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        + "; the runner's host parts in ms per step: "
        + (", ".join(f"{k} {v:.3f}" for k, v in laps.items()) or "-")
    )
    (out / f"{name}.txt").write_text(_report_text(head, averages, py))
    return head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in a.cases.split(","):
        try:
            print(profile_case(name, a.model, a.batch, a.output_len, a.out, a.device), flush=True)
        except Exception as exc:  # one case's failure must not hide the others' profiles
            failed += 1
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
    if torch.cuda.is_available():
        print(f"max GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
