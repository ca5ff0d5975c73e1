"""The README's result tables for the engine benchmarks: async vs sync on the CPU and on the
simulated device, and speculative decoding (used by bench/readme/readme_results.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from baton.bench.sim.engine_sim_report import mode_label
from baton.bench.tables import (
    Column,
    fixed,
    goal_lines,
    num_cell,
    pct_cell,
    section,
    string,
    table,
    text,
)

ENGINE = (
    Column("regime", string("regime")),
    Column("async", mode_label),
    Column("JSON", fixed("json_fraction", ".0%")),
    Column("batch", text("batch")),
    Column("tok/s", fixed("tok_per_s", ".0f")),
    Column("TPOT ms", fixed("tpot_ms", ".1f")),
    Column("device busy (steady)", fixed("steady_device_busy", ".2f")),
    Column("deferred steps", text("deferred_steps")),
    Column("step / max(cpu, device)", fixed("step_over_bound", ".2f")),
)


def engine_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], ENGINE)
    lines = goal_lines(d.get("goals") or [], digits=3)
    caption = (
        "Regime a: the default model. Regime b: a tiny random-weight model with the "
        "real vocabulary (CPU work weighs more, as next to a GPU).\n\n"
    )
    return section(caption, rows, notes=lines)


def _cpu_cell(r: dict[str, Any]) -> str:
    if r.get("cpu_ms_per_step") is None:  # a result written before the column existed
        return "-"
    return f"{r['cpu_ms_per_step']:.2f} ({r['cores_busy']:.2f})"


def _maybe(key: str, spec: str) -> Callable[[dict[str, Any]], str]:
    """A cell of ``row.get(key)`` in ``spec``'s format, "-" for an older result without it."""
    return lambda r: num_cell(r.get(key), spec)


def _phases(r: dict[str, Any]) -> str:
    phases = r.get("phase_ms_per_step") or {}
    names = ("schedule", "bitmask", "launch", "update", "output", "gc")
    return " / ".join(num_cell(phases.get(p), ".2f") for p in names)


ENGINE_SIM = (
    Column("async", mode_label),
    Column("JSON", fixed("json_fraction", ".0%")),
    Column("batch", text("batch")),
    Column("tok/s", fixed("tok_per_s", ".0f")),
    Column("device idle (steady)", lambda r: pct_cell(r.get("steady_idle"))),
    Column("device ms/step", _maybe("device_ms_per_step", ".2f")),
    Column("host ms/step", _maybe("host_ms_per_step", ".2f")),
    Column("host µs/request-step", _maybe("host_us_per_request_step", ".1f")),
    Column("CPU ms/step, all threads (cores busy)", _cpu_cell),
    Column("schedule / bitmask / launch / update / output / gc ms", _phases),
    Column("deferred steps", text("deferred_steps")),
    Column("late wake-up ms/step (OS)", _maybe("wake_late_ms_per_step", ".2f")),
    Column(
        "errors, invalid JSON", lambda r: f"{r['errors']}, {r['json_invalid']}/{r['json_checked']}"
    ),
)
ENGINE_SIM_RATIOS = (
    Column("batch", text("batch")),
    Column("JSON", fixed("json_fraction", ".0%")),
    Column("async / sync", lambda x: num_cell(x["async_over_sync"], ".2f")),
    Column("structured / free (async)", lambda x: num_cell(x["structured_over_free"], ".2f")),
    Column("fill thread on / off (async)", _maybe("fill_thread_gain", ".2f")),
)


def engine_sim_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], ENGINE_SIM)
    ratios = table(d["ratios"], ENGINE_SIM_RATIOS)
    lines = goal_lines(d.get("goals") or [], digits=3)
    caption = (
        f"The real engine on the host against a simulated {d['gpu']['name']} running the "
        f"{d['shape']['name']} shape (roofline step times, token traces, every structured "
        "token checked against its bitmask); the default model's tokenizer. Host load during "
        f"the run: {d.get('load', '-')}. CPU ms/step is the process's CPU time over a whole "
        "run (every thread: engine, fill thread, simulator) per step, and cores busy that "
        f"time over the run's wall time, on {d.get('run', {}).get('cpu_cores', '?')} cores: "
        "a host short of cores shows them all busy, a host held up by the engine thread's "
        "serial work does not.\n\n"
    )
    body = section(caption, rows, ratios, notes=lines)
    if d.get("timeline_png"):
        body += f"\n\n![timeline of steady steps](bench/results/{d['timeline_png']})"
    return body


def _spec_columns(tok_per_s: str) -> list[Column]:
    """The columns a CPU row and a simulated row of the spec tables share."""
    return [
        Column("workload", string("workload")),
        Column("spec", string("mode")),
        Column("concurrency", text("concurrency")),
        Column(tok_per_s, lambda r: num_cell(r["tok_per_s"], ".1f")),
        Column("tokens/step", lambda r: num_cell(r["tokens_per_step"], ".2f")),
        Column("drafts/step", lambda r: num_cell(r["drafts_per_step"], ".2f")),
        Column("acceptance", lambda r: pct_cell(r["acceptance_rate"])),
    ]


SPEC = (
    *_spec_columns("output tok/s"),
    Column("valid JSON", lambda r: pct_cell(r["valid_share"])),
    Column(
        "same tokens as off",
        lambda r: {True: "yes", False: "no", None: "-"}[r["same_tokens_as_off"]],
    ),
    Column(
        "load (1 min avg)",
        lambda r: " -> ".join(f"{x:.1f}" for x in r["load_avg_1m"]) if "load_avg_1m" in r else "",
    ),
)


def spec_table(d: dict[str, Any]) -> str:
    rows = table(d["rows"], SPEC)
    cfg = d["config"]
    caption = (
        f"Greedy JSON workloads (peers: invent a person; extraction: fill a schema from facts "
        f"in the prompt), at most {cfg['max_tokens']} tokens, "
        f"{cfg['num_speculative_tokens']} drafts at most per request and step, synchronous "
        f"scheduling, in {d['run'].get('dtype')}"
        + (f" with `quantization={cfg['quantization']}`" if cfg.get("quantization") else "")
        + "; free is the peers prompts without a schema, "
        f"spec off. One engine per mode, measured in one run: output tok/s is the median of "
        f"{cfg.get('repeats', 1)} run(s) per mode in alternating order"
        + (
            ': a mode drafts as the draft policy chooses, "-fixed" always up to the most.'
            if cfg.get("draft_policy")
            else " (before the draft policy: every mode drafted up to the most)."
        )
        + "\n\n"
    )
    notes = goal_lines(d.get("goals") or [])
    sim = d.get("sim") or {}
    if sim and not sim.get("measured"):
        notes.append(f"- simulated device: not measured ({sim.get('reason')})")
    body = section(caption, rows, notes=notes)
    if sim.get("measured"):
        body += "\n\n" + _spec_sim_table(sim)
    return body


def _spec_sim_table(sim: dict[str, Any]) -> str:
    caption = (
        f"The same prompts on the simulated accelerator (`{sim['device']}`, {sim['shape']} "
        "shape): the real engine replays the spec-off outputs above as its traces, so every "
        "mode verifies drafts against what the model produced; each mode with synchronous and "
        'with async scheduling ("(async)"; under async a request\'s drafts follow a guess of '
        "its token in flight, and it sits out the step planned while they are verified).\n\n"
    )
    notes = [f"- {r['name']}: {num_cell(r['value'], '.2f')}" for r in sim.get("ratios") or []]
    return section(caption, table(sim["rows"], _spec_columns("tok/s")), notes=notes)


# (file, title, command, renderer)
