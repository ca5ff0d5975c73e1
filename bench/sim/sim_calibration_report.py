"""The report of ``bench/sim/sim_calibration.py check``: its README table and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from baton.bench.tables import Column, fixed, table, text

SIM_CALIBRATION = (
    Column("forward", lambda r: "graphs" if r["graphs"] else "eager"),
    Column("scheduling", lambda r: "async" if r["async"] else "sync"),
    Column("requests", lambda r: "JSON" if r["json_fraction"] else "free"),
    Column("batch", text("batch")),
    Column("GPU TPOT ms", fixed("gpu_tpot_ms", ".2f")),
    Column("sim TPOT ms", fixed("sim_tpot_ms", ".2f")),
    Column("sim / GPU", lambda r: f"{r['sim_over_gpu']:.2f}" + ("" if r["within"] else " (out)")),
)


def readme_table(result: dict[str, Any]) -> str:
    """The README's table of a ``check`` result: each GPU cell's TPOT beside the simulator's."""
    run = result.get("run", {})
    caption = (
        f"Every cell of the GPU check (`{Path(result['gpu_result']).name}`) run again on "
        f"`sim:h200` with the calibration `{Path(result['calibration']).name}` "
        f"({result['calibration_source']}), playing the GPU machine's host at time scale "
        f"{result['time_scale']:.3f}; 1-minute load average {result['load']['start']:.1f} at "
        f"the start, {result['load']['end']:.1f} at the end, on {run.get('cpu_cores', '?')} "
        f"cores ({run.get('cpu', '?')}). **{result['cells_within']} of {len(result['rows'])} "
        f"cells within +-{result['tolerance']:.0%}** of the GPU's TPOT."
        + (
            " Synchronous JSON cells drafted as the draft policy chose (the engine's default "
            "now), where the GPU check's engine drafted every draft: sim / GPU below 1 is time "
            "the policy saves, not a calibration error."
            if result.get("drafts") == "adaptive"
            else ""
        )
    )
    return caption + "\n\n" + table(result["rows"], SIM_CALIBRATION)


def plot(result: dict[str, Any], path: Path) -> None:
    """Sim TPOT against GPU TPOT per cell, on log axes, with the tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for row in result["rows"]:
        marker = "o" if row["graphs"] else "s"
        color = "tab:blue" if row["async"] else "tab:orange"
        face = color if row["json_fraction"] else "none"
        ax.scatter(row["gpu_tpot_ms"], row["sim_tpot_ms"], marker=marker, edgecolors=color, c=face)
    lo = min(min(r["gpu_tpot_ms"], r["sim_tpot_ms"]) for r in result["rows"]) * 0.8
    hi = max(max(r["gpu_tpot_ms"], r["sim_tpot_ms"]) for r in result["rows"]) * 1.2
    xs = np.geomspace(lo, hi, 50)
    tol = result["tolerance"]
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * (1 - tol), xs * (1 + tol), color="0.85")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPU TPOT, ms (H200, gpu_check.json)")
    ax.set_ylabel("simulated TPOT, ms (sim:h200, calibrated runner)")
    run = result.get("run", {})
    ax.set_title(
        f"{result['cells_within']}/{len(result['rows'])} cells within +-{tol:.0%}\n"
        f"circles graphs, squares eager; blue async, orange sync; filled JSON\n"
        f"{run.get('commit', '')[:7]} on {run.get('cpu', '')}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
