"""The engine benchmark's report: async/sync and structured/free ratios, goals, table, plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.bench.common import fmt, judge_goal, print_goals, ratio
from baton.bench.plotting import pyplot

# Goal thresholds (targets, not measurements).
BUSY_TARGET = 0.95
STEP_OVERHEAD_TARGET = 1.05
ASYNC_SPEEDUP_TARGET = 1.25
STRUCTURED_TPOT_TARGET = 1.03


def _find(rows: list[dict[str, Any]], key: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in rows if all(r[k] == v for k, v in key.items())), None)


def compute_ratios(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """async/sync throughput per (regime, json fraction, batch) and structured/free TPOT with
    async per (regime, batch), from rows of the same run."""
    speedups = []
    tpot_ratios = []
    for r in rows:
        if not r["async"]:
            continue
        case = {"regime": r["regime"], "json_fraction": r["json_fraction"], "batch": r["batch"]}
        sync = _find(rows, {**case, "async": False})
        if sync is not None:
            speedups.append(
                {
                    "regime": r["regime"],
                    "json_fraction": r["json_fraction"],
                    "batch": r["batch"],
                    "async_over_sync_tok_per_s": ratio(r["tok_per_s"], sync["tok_per_s"]),
                }
            )
        if r["json_fraction"] == 1.0:
            free = _find(rows, {**case, "json_fraction": 0.0, "async": True})
            if free is not None:
                tpot_ratios.append(
                    {
                        "regime": r["regime"],
                        "batch": r["batch"],
                        "structured_over_free_tpot": ratio(r["tpot_ms"], free["tpot_ms"]),
                    }
                )
    return {"async_over_sync": speedups, "structured_over_free": tpot_ratios}


def evaluate_goals(
    rows: list[dict[str, Any]], ratios: dict[str, list[dict[str, Any]]], goal_batch: int
) -> list[dict[str, Any]]:
    """The four goals, each with its measured value(s); nothing is asserted."""
    at_goal = [r for r in rows if r["async"] and r["batch"] == goal_batch]

    def label(r: dict[str, Any]) -> str:
        return f"{r['regime']} json={r['json_fraction']:g} b={r['batch']}"

    speedup = next(
        (
            s["async_over_sync_tok_per_s"]
            for s in ratios["async_over_sync"]
            if s["regime"] == "b" and s["json_fraction"] == 1.0 and s["batch"] == goal_batch
        ),
        None,
    )
    return [
        judge_goal(
            f"steady device busy with async, batch {goal_batch}, every regime",
            f">= {BUSY_TARGET:.0%}",
            {label(r): r["steady_device_busy"] for r in at_goal},
            "min",
            BUSY_TARGET,
        ),
        judge_goal(
            f"async step time / max(CPU, device), batch {goal_batch}",
            f"<= {STEP_OVERHEAD_TARGET}",
            {label(r): r["step_over_bound"] for r in at_goal},
            "max",
            STEP_OVERHEAD_TARGET,
        ),
        judge_goal(
            f"async/sync throughput, regime b, batch {goal_batch}, 100% JSON",
            f">= {ASYNC_SPEEDUP_TARGET}",
            {f"b json=1 b={goal_batch}": speedup},
            "min",
            ASYNC_SPEEDUP_TARGET,
        ),
        judge_goal(
            "structured/free TPOT with async, regime a, every batch",
            f"<= {STRUCTURED_TPOT_TARGET}",
            {
                f"a b={t['batch']}": t["structured_over_free_tpot"]
                for t in ratios["structured_over_free"]
                if t["regime"] == "a"
            },
            "max",
            STRUCTURED_TPOT_TARGET,
        ),
    ]


def _threads(row: dict[str, Any]) -> str:
    """The thread governor's count after the row's runs ("2", "1*" where it changed)."""
    counts = [c for c in row.get("cpu_threads", []) if c is not None]
    if not counts:
        return "-"
    return f"{min(counts)}{'*' if row.get('cpu_thread_changes') else ''}"


def print_report(result: dict[str, Any]) -> None:
    """The rows, the ratios and the goals, as text."""
    head = (
        f"{'reg':<3} {'async':<5} {'json':>4} {'batch':>5} {'tok/s':>8} {'TPOT ms':>8} "
        f"{'busy':>5} {'steady':>6} {'defer':>5} {'wall ms':>8} {'cpu ms':>7} {'dev ms':>7} "
        f"{'wall/max':>8} {'bad json':>8} {'thr':>3}"
    )
    print(head)
    for r in result["rows"]:
        print(
            f"{r['regime']:<3} {'on' if r['async'] else 'off':<5} {r['json_fraction']:>4.0%} "
            f"{r['batch']:>5} {fmt(r['tok_per_s'], '.1f'):>8} {fmt(r['tpot_ms'], '.2f'):>8} "
            f"{fmt(r['device_busy'], '.0%'):>5} {fmt(r['steady_device_busy'], '.0%'):>6} "
            f"{r['deferred_steps']:>5} {fmt(r['step_wall_ms'], '.2f'):>8} "
            f"{fmt(r['step_cpu_ms'], '.2f'):>7} {fmt(r['step_device_ms'], '.2f'):>7} "
            f"{fmt(r['step_over_bound'], '.2f'):>8} "
            f"{r['json_invalid']:>3}/{r['json_checked']:<4} {_threads(r):>3}"
        )
    print("\nasync/sync throughput:")
    for s in result["ratios"]["async_over_sync"]:
        print(
            f"  {s['regime']} json={s['json_fraction']:.0%} batch {s['batch']:>3}: "
            f"{fmt(s['async_over_sync_tok_per_s'], '.2f')}"
        )
    print("structured/free TPOT (async):")
    for t in result["ratios"]["structured_over_free"]:
        print(
            f"  {t['regime']} batch {t['batch']:>3}: {fmt(t['structured_over_free_tpot'], '.3f')}"
        )
    print_goals(result["goals"])
    invalid = sum(r["json_invalid"] for r in result["rows"])
    checked = sum(r["json_checked"] for r in result["rows"])
    print(f"\ninvalid JSON outputs: {invalid} of {checked} that stopped by themselves")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    regimes = list(result["regimes"])
    cols = max(2, len(regimes))
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 7), squeeze=False)
    trace = result["step_trace"]
    for ax, mode in zip(axes[0], ("async", "sync"), strict=False):
        if trace is None:
            ax.set_axis_off()
            continue
        t = trace[mode]
        steps = range(len(t["wall_ms"]))
        ax.plot(steps, t["wall_ms"], color="black", lw=1, label="step wall")
        ax.plot(steps, t["cpu_ms"], color="tab:orange", label="engine CPU")
        ax.plot(steps, t["device_ms"], color="tab:blue", label="device (forward+sample)")
        deferred = [i for i, d in enumerate(t["deferred"]) if d]
        if deferred:
            ax.scatter(
                deferred, [0] * len(deferred), marker="|", color="tab:red", label="deferred step"
            )
        ax.set_xlabel("engine step")
        ax.set_ylabel("ms")
        ax.set_title(
            f"async {'on' if mode == 'async' else 'off'}: regime {trace['regime']}, "
            f"batch {trace['batch']}, {trace['json_fraction']:.0%} JSON"
        )
        ax.legend(fontsize=8)
    for ax in axes[0][2:]:
        ax.set_axis_off()
    for i, ax in enumerate(axes[1]):
        if i >= len(regimes):
            ax.set_axis_off()
            continue
        rows = [r for r in result["rows"] if r["regime"] == regimes[i]]
        cases = sorted({(r["json_fraction"], r["batch"]) for r in rows})
        x = range(len(cases))
        for offset, mode, color in ((-0.2, True, "tab:green"), (0.2, False, "tab:gray")):
            values = [
                next(
                    (
                        r["tok_per_s"] or 0.0
                        for r in rows
                        if (r["json_fraction"], r["batch"]) == c and r["async"] == mode
                    ),
                    0.0,
                )
                for c in cases
            ]
            ax.bar(
                [j + offset for j in x],
                values,
                0.4,
                color=color,
                label=f"async {'on' if mode else 'off'}",
            )
        ax.set_xticks(list(x), [f"{f:.0%} JSON\nb={b}" for f, b in cases], fontsize=7)
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"regime {regimes[i]}: {result['regimes'][regimes[i]]}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
