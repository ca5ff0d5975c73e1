"""The README's result tables for the engine benchmarks: async vs sync on the CPU and on the
simulated device, and speculative decoding (used by bench/readme_results.py)."""

from __future__ import annotations

from typing import Any

from baton.bench.engine_sim_report import mode_label
from baton.bench.readme_tables import goal_lines, markdown_table, num_cell, pct_cell


def engine_table(d: dict[str, Any]) -> str:
    rows = []
    for r in d["rows"]:
        rows.append(
            [
                r["regime"],
                mode_label(r),
                f"{r['json_fraction']:.0%}",
                str(r["batch"]),
                f"{r['tok_per_s']:.0f}",
                f"{r['tpot_ms']:.1f}",
                f"{r['steady_device_busy']:.2f}",
                str(r["deferred_steps"]),
                f"{r['step_over_bound']:.2f}",
            ]
        )
    header = [
        "regime",
        "async",
        "JSON",
        "batch",
        "tok/s",
        "TPOT ms",
        "device busy (steady)",
        "deferred steps",
        "step / max(cpu, device)",
    ]
    lines = goal_lines(d.get("goals") or [], digits=3)
    caption = (
        "Regime a: the default model. Regime b: a tiny random-weight model with the "
        "real vocabulary (CPU work weighs more, as next to a GPU).\n\n"
    )
    return caption + markdown_table(header, rows) + ("\n\n" + "\n".join(lines) if lines else "")


def _cpu_cell(r: dict[str, Any]) -> str:
    if r.get("cpu_ms_per_step") is None:  # a result written before the column existed
        return "-"
    return f"{r['cpu_ms_per_step']:.2f} ({r['cores_busy']:.2f})"


def engine_sim_table(d: dict[str, Any]) -> str:
    rows = []
    for r in d["rows"]:
        phases = r.get("phase_ms_per_step") or {}
        rows.append(
            [
                mode_label(r),
                f"{r['json_fraction']:.0%}",
                str(r["batch"]),
                f"{r['tok_per_s']:.0f}",
                pct_cell(r.get("steady_idle")),
                num_cell(r.get("device_ms_per_step"), ".2f"),
                num_cell(r.get("host_ms_per_step"), ".2f"),
                num_cell(r.get("host_us_per_request_step"), ".1f"),
                _cpu_cell(r),
                " / ".join(
                    num_cell(phases.get(p), ".2f")
                    for p in ("schedule", "bitmask", "launch", "update", "output", "gc")
                ),
                str(r["deferred_steps"]),
                num_cell(r.get("wake_late_ms_per_step"), ".2f"),
                f"{r['errors']}, {r['json_invalid']}/{r['json_checked']}",
            ]
        )
    header = [
        "async",
        "JSON",
        "batch",
        "tok/s",
        "device idle (steady)",
        "device ms/step",
        "host ms/step",
        "host µs/request-step",
        "CPU ms/step, all threads (cores busy)",
        "schedule / bitmask / launch / update / output / gc ms",
        "deferred steps",
        "late wake-up ms/step (OS)",
        "errors, invalid JSON",
    ]
    ratios = [
        [
            str(x["batch"]),
            f"{x['json_fraction']:.0%}",
            num_cell(x["async_over_sync"], ".2f"),
            num_cell(x["structured_over_free"], ".2f"),
            num_cell(x.get("fill_thread_gain"), ".2f"),
        ]
        for x in d["ratios"]
    ]
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
    return (
        caption
        + markdown_table(header, rows)
        + "\n\n"
        + markdown_table(
            [
                "batch",
                "JSON",
                "async / sync",
                "structured / free (async)",
                "fill thread on / off (async)",
            ],
            ratios,
        )
        + ("\n\n" + "\n".join(lines) if lines else "")
        + (
            f"\n\n![timeline of steady steps](bench/results/{d['timeline_png']})"
            if d.get("timeline_png")
            else ""
        )
    )


def _spec_cells(r: dict[str, Any]) -> list[str]:
    """The cells a CPU row and a simulated row of the spec tables share."""
    return [
        r["workload"],
        r["mode"],
        str(r["concurrency"]),
        num_cell(r["tok_per_s"], ".1f"),
        num_cell(r["tokens_per_step"], ".2f"),
        num_cell(r["drafts_per_step"], ".2f"),
        pct_cell(r["acceptance_rate"]),
    ]


def spec_table(d: dict[str, Any]) -> str:
    rows = [
        [
            *_spec_cells(r),
            pct_cell(r["valid_share"]),
            {True: "yes", False: "no", None: "-"}[r["same_tokens_as_off"]],
            " -> ".join(f"{x:.1f}" for x in r["load_avg_1m"]) if "load_avg_1m" in r else "",
        ]
        for r in d["rows"]
    ]
    header = [
        "workload",
        "spec",
        "concurrency",
        "output tok/s",
        "tokens/step",
        "drafts/step",
        "acceptance",
        "valid JSON",
        "same tokens as off",
        "load (1 min avg)",
    ]
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
    text = caption + markdown_table(header, rows) + ("\n\n" + "\n".join(notes) if notes else "")
    if sim.get("measured"):
        text += "\n\n" + _spec_sim_table(sim)
    return text


def _spec_sim_table(sim: dict[str, Any]) -> str:
    rows = [_spec_cells(r) for r in sim["rows"]]
    header = ["workload", "spec", "concurrency", "tok/s", "tokens/step", "drafts/step"]
    header.append("acceptance")
    caption = (
        f"The same prompts on the simulated accelerator (`{sim['device']}`, {sim['shape']} "
        "shape): the real engine replays the spec-off outputs above as its traces, so every "
        "mode verifies drafts against what the model produced; each mode with synchronous and "
        'with async scheduling ("(async)"; under async a request\'s drafts follow a guess of '
        "its token in flight, and it sits out the step planned while they are verified).\n\n"
    )
    notes = [f"- {r['name']}: {num_cell(r['value'], '.2f')}" for r in sim.get("ratios") or []]
    return caption + markdown_table(header, rows) + ("\n\n" + "\n".join(notes) if notes else "")


# (file, title, command, renderer)
