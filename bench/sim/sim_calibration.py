"""Fits the simulated accelerator's runner costs to the GPU check, and checks the fit per cell.

The GPU check (``bench/gpu/gpu_check.py``) ran ``baton bench engine`` on a GPU: the default
model's shape with random weights, batches 1-256, free and JSON requests, async and sync
scheduling, with the decode CUDA graphs and without (``enforce_eager``). This runs the same
workload (the same prompts, lengths, schema, engine settings and drafts) on the simulated
device of that GPU, with traces in place of the model's tokens, and

  fit    runs it with the runner's costs at zero (the engine's own host time per step, here,
         and what each step was: graphed or op by op, rows, logits rows, bitmask rows), scales
         the engine's time to the GPU machine's host (the ratio of the engine's phase times
         there, in the GPU profile, to the same phases here), and fits the runner's host
         coefficients (``engine/executor/sim_runner.py``) to the difference between the
         GPU's host time per step and the engine's, every cell at once, by non-negative least
         squares; the kernel floor and kernel counts come from the GPU profile. Writes
         ``engine/executor/sim_calibration.json`` (or ``--calibration``).
  check  runs every cell with the calibrated runner, in slow motion by the host ratio (so
         that the engine here plays the GPU machine's host), and compares each cell's TPOT
         with the GPU's. Writes ``bench/results/sim_calibration.json`` and a plot.

    python -m baton.bench.sim.sim_calibration fit [--gpu-result F] [--profile-log F] [--runs 3]
    python -m baton.bench.sim.sim_calibration check [--gpu-result F] [--calibration F] [--runs 3]
        [--drafts fixed|adaptive] [--only 'sync json']

A new GPU check recalibrates with ``fit`` then ``check`` (one command each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from baton.bench import common
from baton.bench.common import RESULTS_DIR, write_results
from baton.bench.offline.engine import (
    BLOCK_SIZE,
    STEADY_TRIM,
    conversations,
    measure,
    request_params,
    summarize,
)
from baton.bench.sim.sim_calibration_report import plot
from baton.engine import LLM
from baton.engine.executor.sim import SimExecutor
from baton.engine.executor.sim_runner import (
    CALIBRATION_PATH,
    HOST_COEFFICIENTS,
    RunnerCalibration,
    RunnerStep,
)
from baton.engine.executor.sim_traces import Trace, TraceBook
from baton.engine.host_speed import measure_host_speed
from baton.engine.loader import load_tokenizer
from baton.engine.tokenizer import Tokenizer

GPU_RESULT = RESULTS_DIR / "gpu_check.json"
PROFILE_LOG = RESULTS_DIR / "gpu_profile_e6fd73d" / "profile.log"
SHAPE = "smollm2-135m"
TOLERANCE = 0.25  # the bound on |sim / GPU - 1| per cell
# The engine's own phases, the same code on both hosts: their ratio is the host ratio.
ENGINE_PHASES = ("schedule", "update", "output")
# The profile's runner laps that belong to sample_tokens (the rest are execute_model's).
SAMPLE_LAPS = ("grammar", "bans_and_metadata", "sampler", "record", "to_host")
WARMUP_TOKENS = 4

_CITIES = ("Madrid", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth", "Turin")
_NAMES = ("Ana Ruiz", "Bo Chen", "Cleo Diaz", "Dev Rao", "Eva Holm", "Finn Ott", "Gia Lu")
_JOBS = ("baker", "pilot", "chess coach", "gardener", "painter", "doctor")
_HOBBIES = ("chess", "running", "reading", "baking", "sailing", "drawing")
# Free text the free requests' traces spell (any tokens serve: nothing constrains them).
_STORY = (
    "The lighthouse keeper counted the ships every evening, writing their names in a worn "
    "ledger that had belonged to her grandmother. One night a vessel without a name drifted "
    "past the rocks, its lanterns burning green, and she followed it along the shore until "
    "dawn broke over the harbour and the fishermen began to gather their nets in silence."
)


# ------------------------------------------------------------------ workload
def json_instance(i: int) -> dict[str, Any]:
    """A valid instance of the GPU check's schema (``bench.offline.engine.SCHEMA``), varied by
    ``i``; about as long as the random-weight model's outputs there (48 tokens on average)."""
    name, city = _NAMES[i % len(_NAMES)], _CITIES[i % len(_CITIES)]
    return {
        "name": name,
        "age": 20 + i % 60,
        "city": city,
        "occupation": _JOBS[i % len(_JOBS)],
        "hobbies": [_HOBBIES[i % len(_HOBBIES)], _HOBBIES[(i + 1) % len(_HOBBIES)]],
        "bio": f"Lives in {city} and loves long walks #{i % 97}",
    }


def workload(
    tok: Tokenizer, batch: int, fraction: float, start: int, output_len: int
) -> tuple[list[list[int]], list[Any], list[Trace]]:
    """The GPU check's prompts and parameters for one case, and the traces that answer them."""
    prompts = [list(tok.apply_chat_template(c, tokenize=True)) for c in conversations(start, batch)]
    params = request_params(batch, fraction, output_len)
    story = tuple(tok.encode(_STORY))
    free = (story * (output_len // len(story) + 1))[:output_len]
    traces = []
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        if sp.structured_outputs is None:
            traces.append(Trace(tuple(prompt), free))
        else:
            text = json.dumps(json_instance(start + i), separators=(",", ":"))
            traces.append(Trace(tuple(prompt), tuple(tok.encode(text))))
    return prompts, params, traces


def gpu_cells(path: Path) -> list[dict[str, Any]]:
    """The GPU check's engine rows: one per (graphs, async, JSON share, batch)."""
    data = json.loads(path.read_text())
    cells = []
    for regime, block in data["engine"].items():
        for row in block["rows"]:
            cells.append(
                {
                    "graphs": regime == "graphs",
                    "async": row["async"],
                    "json_fraction": row["json_fraction"],
                    "batch": row["batch"],
                    "tpot_ms": row["tpot_ms"],
                    "step_cpu_ms": row["step_cpu_ms"],
                    "output_len": block["output_len"],
                    "repeats": block["repeats"],
                }
            )
    return cells


def profile_figures(path: Path) -> dict[str, dict[str, Any]]:
    """Per profiled case of the GPU profile's log: the engine's phases and the runner's laps
    (ms per step), GPU kernels per step and GPU ms per step."""
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        m = re.match(
            r"(\w+): batch (\d+),.*\((\d+) GPU kernels and copies per step, ([\d.]+) ms", line
        )
        if not m:
            continue

        def pairs(label: str, text: str = line) -> dict[str, float]:
            part = text.split(label, 1)[1].split(";")[0]
            return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", part)}

        out[m.group(1)] = {
            "batch": int(m.group(2)),
            "kernels": int(m.group(3)),
            "gpu_ms": float(m.group(4)),
            "phases": pairs("engine phases in ms per step:"),
            "laps": pairs("the runner's host parts in ms per step:"),
        }
    return out


# ------------------------------------------------------------------ running
def build_llm(
    model: str | None,
    traces: Path,
    async_on: bool,
    graphs: bool,
    max_batch: int,
    max_len: int,
    runner: str,
    time_scale: float,
    adaptive_drafts: bool = False,
) -> LLM:
    """An engine on the simulated H200 as the GPU check built one on CUDA: drafts for
    structured requests only under synchronous scheduling (CUDA turns them off under async),
    every draft each step as the engine of that check drafted (``adaptive_drafts``: as many
    as the draft policy finds worth their rows, today's default)."""
    blocks_per_seq = -(-max_len // BLOCK_SIZE) + 1
    spec = None
    if not async_on:
        spec = {"method": "auto", "structured_only": True, "adaptive": adaptive_drafts}
    return LLM(
        model,
        device="sim:h200",
        sim_shape=SHAPE,
        sim_traces=str(traces),
        sim_runner=runner,
        sim_time_scale=time_scale,
        async_scheduling=async_on,
        speculative_config=spec,
        structured_drafts=False,
        enforce_eager=not graphs,
        max_num_seqs=max_batch,
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * blocks_per_seq + 8,
        grammar_compile_timeout_s=120.0,
    )


def _step_features(steps: Sequence[RunnerStep]) -> list[float]:
    """Mean features of a run's steady steps (trimmed as ``bench.offline.engine`` trims its
    rows)."""
    steady = list(steps[STEADY_TRIM : len(steps) - STEADY_TRIM]) or list(steps)
    if not steady:
        return [0.0] * len(HOST_COEFFICIENTS)
    feats = np.array([s.features() for s in steady], dtype=np.float64)
    return [float(v) for v in feats.mean(axis=0)]


def run_cells(
    cells: Sequence[dict[str, Any]],
    model: str | None,
    runner: str,
    time_scale: float,
    adaptive_drafts: bool = False,
) -> list[dict[str, Any]]:
    """Runs every cell's workload on the simulator; one result per cell, in ``cells``'
    order: TPOT and host time per step (divided by ``time_scale``), the engine phases, and
    the mean runner features of the steady steps (``adaptive_drafts``: see ``build_llm``)."""
    tok = load_tokenizer(model)
    output_len = max(c["output_len"] for c in cells)
    max_batch = max(c["batch"] for c in cells)
    plans, start = [], 0
    for cell in cells:
        for _ in range(cell["repeats"]):
            plans.append(
                (cell, *workload(tok, cell["batch"], cell["json_fraction"], start, output_len))
            )
            start += cell["batch"]
    warm = workload(tok, 4, 0.5, start, WARMUP_TOKENS)
    book = TraceBook([t for plan in plans for t in plan[3]] + warm[2])
    longest = max(len(p) for plan in plans for p in plan[1])
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "traces.jsonl"
        book.save(path)
        for graphs in (True, False):
            for async_on in (True, False):
                mine = [p for p in plans if (p[0]["graphs"], p[0]["async"]) == (graphs, async_on)]
                if not mine:
                    continue
                llm = build_llm(
                    model, path, async_on, graphs, max_batch, longest + output_len + 1,
                    runner, time_scale, adaptive_drafts,
                )  # fmt: skip
                try:
                    llm.generate(warm[0], warm[1], use_tqdm=False)
                    _run_plans(llm, mine, results, time_scale)
                finally:
                    llm.shutdown()
    return [results[id(c)] for c in cells]


def _run_plans(
    llm: LLM, plans: Sequence[tuple], results: dict[int, dict[str, Any]], time_scale: float
) -> None:
    executor = llm.engine.core.executor
    assert isinstance(executor, SimExecutor)
    by_cell: dict[int, list[tuple]] = {}
    for cell, prompts, params, _ in plans:
        before_steps = len(executor.runner_steps())
        before = llm.stats()
        run = measure(llm, prompts, params)
        after = llm.stats()
        steps = executor.runner_steps()[before_steps:]
        by_cell.setdefault(id(cell), []).append((cell, run, before, after, steps))
    for key, runs in by_cell.items():
        cell = runs[0][0]
        row = summarize([r[1] for r in runs], "a", llm, cell["json_fraction"], cell["batch"])
        n_steps = sum(r[3]["steps"] - r[2]["steps"] for r in runs)
        phases = {
            p: sum(r[3].get(f"{p}_s", 0.0) - r[2].get(f"{p}_s", 0.0) for r in runs)
            / max(1, n_steps)
            * 1e3
            / time_scale
            for p in (*ENGINE_PHASES, "bitmask")
        }
        feats = [_step_features(r[4]) for r in runs]
        results[key] = {
            "tpot_ms": row["tpot_ms"] / time_scale,
            "step_cpu_ms": row["step_cpu_ms"] / time_scale,
            "steps": row["steps"],
            "json_invalid": row["json_invalid"],
            "json_checked": row["json_checked"],
            "phases_ms": phases,
            "features": [statistics.fmean(f[i] for f in feats) for i in range(len(feats[0]))],
        }


def least_engine(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell, the run whose engine took the least host time per step: the one another
    process on the machine disturbed least (the engine's time is measured live)."""
    return [min(cell_runs, key=lambda r: r["step_cpu_ms"]) for cell_runs in zip(*runs, strict=True)]


def median_tpot(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell, the run of median TPOT."""
    out = []
    for cell_runs in zip(*runs, strict=True):
        ordered = sorted(cell_runs, key=lambda r: r["tpot_ms"])
        out.append(ordered[len(ordered) // 2])
    return out


# ------------------------------------------------------------------ fitting
def nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, drop the most negative coefficient's
    column (its coefficient becomes 0), solve again, until none is negative."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol = np.linalg.lstsq(a[:, active], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def host_ratio(sim: Sequence[dict[str, Any]], cells: Sequence[dict[str, Any]], prof: dict) -> float:
    """How many times longer this host takes for the engine's own phases than the GPU
    machine's host did, over the profiled cells (async, graphs, batch 32, free and JSON)."""
    here = there = 0.0
    for name, frac in (("async_free_graphs", 0.0), ("async_json_graphs", 1.0)):
        if name not in prof:
            continue
        for cell, res in zip(cells, sim, strict=True):
            key = (cell["graphs"], cell["async"], cell["json_fraction"], cell["batch"])
            if key == (True, True, frac, prof[name]["batch"]):
                here += sum(res["phases_ms"][p] for p in ENGINE_PHASES)
                there += sum(prof[name]["phases"][p] for p in ENGINE_PHASES)
    if there <= 0 or here <= 0:
        raise SystemExit("the GPU profile and the cells share no profiled case: no host ratio")
    return here / there


def fit(
    cells: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]], ratio: float, prof: dict
) -> tuple[dict[str, float], list[float]]:
    """The host coefficients (seconds of the GPU machine's host) that best explain each cell's
    host time per step beyond the engine's own, by non-negative least squares weighted by
    1/(the cell's whole host time per step); and the split of the fixed
    part into ``step_s`` and ``sample_s``. Returns the coefficients and each cell's target."""
    a = np.array([res["features"] for res in sim], dtype=np.float64)
    engine_ms = np.array([res["step_cpu_ms"] for res in sim]) / ratio
    total = np.array([c["step_cpu_ms"] for c in cells])
    y = total - engine_ms
    # Errors relative to each cell's whole host time (what its TPOT follows), so that fast
    # and slow cells count alike.
    w = 1.0 / total
    coef = nonneg_lstsq(a * w[:, None], y * w)
    values = {name: float(v) * 1e-3 for name, v in zip(HOST_COEFFICIENTS, coef, strict=True)}
    # Split the fixed part as the profile splits the runner's laps at batch 32.
    laps = prof.get("async_free_graphs", {}).get("laps", {})
    sample_ms = sum(laps.get(k, 0.0) for k in SAMPLE_LAPS)
    sample_s = min(values["step_s"], max(0.0, sample_ms * 1e-3))
    values["sample_s"] = sample_s
    values["step_s"] -= sample_s
    return values, [float(v) for v in y]


def device_figures(prof: dict, num_layers: int) -> dict[str, float]:
    """Kernel floor and counts from the profile: a graphed decode forward's kernels over its
    GPU time gives the floor (its GEMMs at batch 32 of a 135M model are floor-bound too);
    the eager case's kernels, above the graphed ones, are the op-by-op extras."""
    free = prof["async_free_graphs"]
    eager = prof.get("sync_json_drafts", free)
    floor = free["gpu_ms"] / free["kernels"] * 1e-3
    # About ten kernels per layer in the graph (norms, projections, rope, attention, SiLU);
    # the rest is the fixed part (embedding, final norm, LM head, sampling).
    sample_kernels, mask_kernels = 8.0, 2.0
    graph_fixed = 20.0
    per_layer = (free["kernels"] - graph_fixed - sample_kernels) / num_layers
    eager_fixed = 40.0
    eager_per_layer = (eager["kernels"] - eager_fixed - sample_kernels - mask_kernels) / num_layers
    return {
        "kernel_floor_s": floor,
        "graph_kernels_per_layer": per_layer,
        "graph_kernels_fixed": graph_fixed,
        "eager_kernels_per_layer": eager_per_layer,
        "eager_kernels_fixed": eager_fixed,
        "sample_kernels": sample_kernels,
        "mask_kernels": mask_kernels,
    }


# ------------------------------------------------------------------ commands
def zero_calibration(prof: dict, host_speed_s: float) -> RunnerCalibration:
    """The profile's device figures with every host cost at zero: a run with it measures the
    engine alone and records what each step was."""
    dev = device_figures(prof, _num_layers())
    zeros = dict.fromkeys(HOST_COEFFICIENTS, 0.0)
    return RunnerCalibration(
        source="zero host costs (fit's collect run)",
        host_speed_s=host_speed_s,
        host_speed_estimated=True,
        max_graph_batch=_max_graph_batch(),
        sample_s=0.0,
        **dev,
        **zeros,
    )


def _num_layers() -> int:
    from baton.engine.sim_specs import SHAPES

    return SHAPES[SHAPE].num_layers


def _max_graph_batch() -> int:
    # The CUDA runner's rule (engine/worker/cuda_graphs.py), without importing the worker.
    return 512


def _cell_key(cell: dict[str, Any]) -> str:
    mode = "async" if cell["async"] else "sync"
    kind = "json" if cell["json_fraction"] else "free"
    return f"{'graphs' if cell['graphs'] else 'eager'} {mode} {kind} b{cell['batch']}"


def cmd_fit(a: argparse.Namespace) -> int:
    cells = gpu_cells(a.gpu_result)
    prof = profile_figures(a.profile_log)
    local = measure_host_speed()
    with tempfile.TemporaryDirectory() as tmp:
        zero_path = Path(tmp) / "zero.json"
        zero = zero_calibration(prof, local)
        zero_path.write_text(json.dumps({"calibration": zero.to_json()}))
        runs = [run_cells(cells, a.model, str(zero_path), 1.0) for _ in range(a.runs)]
    sim = least_engine(runs)
    gpu = json.loads(a.gpu_result.read_text())
    recorded = gpu.get("env", {}).get("host_speed_s")
    ratio = local / recorded if recorded else host_ratio(sim, cells, prof)
    values, targets = fit(cells, sim, ratio, prof)
    dev = device_figures(prof, _num_layers())
    gpu_run = gpu.get("run", {})
    calibration = RunnerCalibration(
        source=(
            f"{a.gpu_result.name} at {gpu_run.get('commit', '?')[:7]} "
            f"({gpu.get('env', {}).get('device', '?')}), "
            f"profile {a.profile_log.parent.name}"
        ),
        host_speed_s=local / ratio,
        host_speed_estimated=not recorded,
        max_graph_batch=_max_graph_batch(),
        **dev,
        **values,
    )
    fitted = []
    coefs = np.array(calibration.host_coefficients()) * 1e3
    for cell, res, target in zip(cells, sim, targets, strict=True):
        model_ms = float(np.dot(res["features"], coefs)) + calibration.sample_s * 1e3
        fitted.append(
            {
                "cell": _cell_key(cell),
                "gpu_step_cpu_ms": cell["step_cpu_ms"],
                "engine_ms_scaled": res["step_cpu_ms"] / ratio,
                "runner_target_ms": target,
                "runner_model_ms": model_ms,
                "engine_phases_ms": res["phases_ms"],
                "features": dict(zip(HOST_COEFFICIENTS, res["features"], strict=True)),
            }
        )
        print(f"{_cell_key(cell):24s} target {target:7.2f} ms  model {model_ms:7.2f} ms")
    out = {
        "calibration": calibration.to_json(),
        "host_ratio": ratio,
        "local_host_speed_s": local,
        "runs": a.runs,
        "fit_run": common.run_info(),
        "cells": fitted,
    }
    a.calibration.write_text(json.dumps(out, indent=1) + "\n")
    print(f"host ratio {ratio:.3f} (this host / GPU machine's); wrote {a.calibration}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    from baton.engine.executor.sim_runner import load_calibration

    cells = [c for c in gpu_cells(a.gpu_result) if a.only in _cell_key(c)]
    if not cells:
        raise SystemExit(f"no GPU cell's name holds {a.only!r}")
    calibration = load_calibration(a.calibration)
    local = measure_host_speed()
    scale = local / calibration.host_speed_s
    load_start = os.getloadavg()[0]
    adaptive = a.drafts == "adaptive"
    sim = median_tpot(
        [run_cells(cells, a.model, str(a.calibration), scale, adaptive) for _ in range(a.runs)]
    )
    rows = []
    for cell, res in zip(cells, sim, strict=True):
        ratio = res["tpot_ms"] / cell["tpot_ms"]
        rows.append(
            {
                **{k: cell[k] for k in ("graphs", "async", "json_fraction", "batch")},
                "cell": _cell_key(cell),
                "gpu_tpot_ms": cell["tpot_ms"],
                "sim_tpot_ms": res["tpot_ms"],
                "sim_over_gpu": ratio,
                "within": abs(ratio - 1) <= TOLERANCE,
                "gpu_step_cpu_ms": cell["step_cpu_ms"],
                "sim_step_cpu_ms": res["step_cpu_ms"],
                "json_invalid": res["json_invalid"],
            }
        )
        print(
            f"{_cell_key(cell):24s} GPU {cell['tpot_ms']:7.2f}  sim {res['tpot_ms']:7.2f}  "
            f"x{ratio:5.2f}{'' if abs(ratio - 1) <= TOLERANCE else '  OUT'}"
        )
    within = sum(r["within"] for r in rows)
    print(f"{within} of {len(rows)} cells within +-{TOLERANCE:.0%} (time scale {scale:.3f})")
    result = {
        "gpu_result": str(a.gpu_result),
        "calibration": str(a.calibration),
        "calibration_source": calibration.source,
        "time_scale": scale,
        "runs": a.runs,
        "drafts": a.drafts,
        "tolerance": TOLERANCE,
        "cells_within": within,
        "rows": rows,
        "load": {"start": load_start, "end": os.getloadavg()[0]},
    }
    write_results(result, a.out, plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``fit`` or ``check`` (see the module docstring); exits through argparse on a bad
    argument."""
    p = argparse.ArgumentParser(
        prog="baton bench sim_calibration", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("fit", "check"):
        s = sub.add_parser(name)
        s.add_argument("--gpu-result", type=Path, default=GPU_RESULT)
        s.add_argument("--calibration", type=Path, default=CALIBRATION_PATH)
        s.add_argument("--model", default=None, help="the tokenizer (default: SmolLM2-135M's)")
        s.add_argument(
            "--runs",
            type=int,
            default=3,
            help="whole runs of every cell (fit: each cell's least engine time; check: each "
            "cell's median TPOT); default 3",
        )
        if name == "fit":
            s.add_argument("--profile-log", type=Path, default=PROFILE_LOG)
        else:
            s.add_argument("--out", type=Path, default=RESULTS_DIR / "sim_calibration.json")
            s.add_argument(
                "--drafts",
                choices=("fixed", "adaptive"),
                default="fixed",
                help="synchronous JSON cells: every draft, as the GPU check's engine drafted "
                "(default), or the draft policy's choice (the engine's default now)",
            )
            s.add_argument("--only", default="", help="only the cells whose name holds this")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error(f"--runs must be >= 1, got {a.runs}")
    return cmd_fit(a) if a.command == "fit" else cmd_check(a)


if __name__ == "__main__":
    raise SystemExit(main())
