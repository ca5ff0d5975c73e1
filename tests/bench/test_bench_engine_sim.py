"""bench/sim/engine_sim.py's ratios and goals over its three engines (no simulation run here)."""

from __future__ import annotations

from typing import Any

from baton.bench.sim.engine_sim import compute_ratios, evaluate_goals
from baton.bench.sim.engine_sim_report import mode_label


def row(
    async_on: bool, fill: bool | None, fraction: float, tok: float, idle: float
) -> dict[str, Any]:
    return {
        "async": async_on,
        "fill_thread": fill,
        "batch": 64,
        "json_fraction": fraction,
        "tok_per_s": tok,
        "steady_idle": idle,
    }


def test_ratios_compare_async_with_its_fill_thread_and_goals_ignore_the_other_engine() -> None:
    rows = [
        row(True, True, 0.0, 1000.0, 0.0),
        row(False, None, 0.0, 800.0, 0.2),
        row(True, True, 1.0, 960.0, 0.01),
        row(False, None, 1.0, 600.0, 0.3),
        row(True, False, 1.0, 640.0, 0.4),  # each fill on the engine thread
    ]
    ratios = {x["json_fraction"]: x for x in compute_ratios(rows)}
    assert len(compute_ratios(rows)) == 2  # one per async row with the fill thread
    assert ratios[1.0]["async_over_sync"] == 960 / 600
    assert ratios[1.0]["structured_over_free"] == 960 / 1000
    assert ratios[1.0]["fill_thread_gain"] == 960 / 640
    assert ratios[0.0]["fill_thread_gain"] is None
    idle = next(g for g in evaluate_goals(rows, list(ratios.values())) if "idle" in g["goal"])
    assert idle["value"] == 0.01  # not the engine-thread fill's 0.4
    assert [mode_label(r) for r in rows[2:]] == ["on", "off", "on, fill on engine thread"]
    old = {k: v for k, v in rows[0].items() if k != "fill_thread"}  # a result from before
    assert mode_label(old) == "on" and compute_ratios([old])[0]["fill_thread_gain"] is None


def test_tables_show_the_runs_cpu_time_and_rows_from_before_it_existed(capsys: Any) -> None:
    from baton.bench.readme.readme_engine_tables import engine_sim_table
    from baton.bench.sim.engine_sim_report import print_report

    base = {"deferred_steps": 3, "errors": 0, "json_invalid": 0, "json_checked": 4}
    measured = {**row(True, False, 1.0, 640.0, 0.4), **base, "cpu_ms_per_step": 7.05}
    measured["cores_busy"] = 1.18
    before = {**row(False, None, 1.0, 600.0, 0.3), **base}  # written before the column
    result = {"rows": [measured, before], "ratios": [], "goals": [], "run": {"cpu_cores": 2}}
    result |= {"gpu": {"name": "H200"}, "shape": {"name": "llama"}}
    table = engine_sim_table(result)
    assert "CPU ms/step, all threads (cores busy)" in table
    assert "on 2 cores" in table
    lines = [x for x in table.splitlines() if x.startswith("| on") or x.startswith("| off")]
    assert "| 7.05 (1.18) |" in lines[0] and "| - |" in lines[1]
    print_report({"rows": [measured, before], "ratios": [], "goals": []})
    out = capsys.readouterr().out
    assert "on, eng" in out and " 7.05  1.18 " in out
