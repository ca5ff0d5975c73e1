"""The simulated-device engine benchmark's report: the table as text, the throughput and idle
plot, and the timeline plot of a few steady steps (host lanes vs the device lane)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.bench.common import fmt, print_goals
from baton.bench.plotting import pyplot

PHASE_COLORS = {
    "schedule": "tab:blue",
    "bitmask": "tab:purple",
    "launch": "tab:gray",
    "wait": "whitesmoke",
    "update": "tab:orange",
    "output": "tab:green",
}
DEVICE_COLORS = {"forward": "tab:red", "sample": "gold"}


def mode_label(row: dict[str, Any]) -> str:
    """How a row's engine scheduled: "on" (async), "off" (sync), or "on, fill on engine
    thread" (async with each deferred fill on the engine thread)."""
    if not row["async"]:
        return "off"
    return "on" if row.get("fill_thread", True) is not False else "on, fill on engine thread"


# The console's narrow column ("on, eng": async with each deferred fill on the engine thread).
_SHORT_LABELS = {"off": "off", "on": "on", "on, fill on engine thread": "on, eng"}


def print_report(result: dict[str, Any]) -> None:
    """The rows, ratios and goals as text."""
    print(
        f"\n{'async':<8} {'json':>4} {'batch':>5} {'tok/s':>8} {'steady':>8} {'idle':>6} "
        f"{'step ms':>7} {'dev ms':>7} {'host ms':>7} {'us/req':>7} {'cpu ms':>6} {'cores':>5} "
        f"{'defer':>5} {'sched':>6} {'mask':>6} {'launch':>6} {'update':>6} {'output':>6} "
        f"{'gc':>6} {'late':>5} "
        f"{'err':>3} {'bad':>3}"
    )
    for r in result["rows"]:
        ph = r.get("phase_ms_per_step") or {}
        print(
            f"{_SHORT_LABELS[mode_label(r)]:<8} {r['json_fraction']:>4.0%} {r['batch']:>5} "
            f"{r['tok_per_s']:>8.0f} {fmt(r.get('steady_tok_per_s'), '.0f'):>8} "
            f"{fmt(r.get('steady_idle'), '.1%'):>6} {fmt(r.get('step_ms'), '.2f'):>7} "
            f"{fmt(r.get('device_ms_per_step'), '.2f'):>7} "
            f"{fmt(r.get('host_ms_per_step'), '.2f'):>7} "
            f"{fmt(r.get('host_us_per_request_step'), '.1f'):>7} "
            f"{fmt(r.get('cpu_ms_per_step'), '.2f'):>6} {fmt(r.get('cores_busy'), '.2f'):>5} "
            f"{r['deferred_steps']:>5} "
            + " ".join(
                f"{fmt(ph.get(p), '.2f'):>6}"
                for p in ("schedule", "bitmask", "launch", "update", "output", "gc")
            )
            + f" {fmt(r.get('wake_late_ms_per_step'), '.2f'):>5}"
            + f" {r['errors']:>3} {r['json_invalid']:>3}"
        )
    print("\nasync/sync, structured/free (async), fill thread on/off (async) throughput:")
    for x in result["ratios"]:
        print(
            f"  batch {x['batch']:>4} json {x['json_fraction']:.0%}: async/sync "
            f"{fmt(x['async_over_sync'], '.2f')}, structured/free "
            f"{fmt(x['structured_over_free'], '.2f')}, fill thread on/off "
            f"{fmt(x.get('fill_thread_gain'), '.2f')}"
        )
    print_goals(result["goals"])


def timeline_path(path: Path) -> Path:
    """Where the timeline plot of the result plotted at ``path`` goes."""
    return path.with_name(path.stem + "_timeline.png")


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput and steady idle per case at ``path``; the timeline beside it."""
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    cases = sorted({(r["json_fraction"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    x = range(len(cases))
    for offset, mode, color in ((-0.2, True, "tab:green"), (0.2, False, "tab:gray")):
        by_case = {
            (r["json_fraction"], r["batch"]): r
            for r in rows
            if r["async"] == mode and r.get("fill_thread") is not False
        }
        label = f"async {'on' if mode else 'off'}"
        axes[0].bar(
            [i + offset for i in x],
            [by_case[c]["tok_per_s"] if c in by_case else 0 for c in cases],
            0.4,
            color=color,
            label=label,
        )
        axes[1].bar(
            [i + offset for i in x],
            [(by_case[c].get("steady_idle") or 0) * 100 if c in by_case else 0 for c in cases],
            0.4,
            color=color,
            label=label,
        )
    labels = [f"{f:.0%} JSON\nb={b}" for f, b in cases]
    for ax, ylabel in zip(
        axes, ("output tokens / s", "device idle in steady decode, %"), strict=True
    ):
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].axhline(5, color="black", lw=0.8, ls="--")
    shape, gpu = result["shape"]["name"], result["gpu"]["name"]
    fig.suptitle(f"{shape} shape on a simulated {gpu}: the real engine on the host")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    _plot_timeline(plt, result, timeline_path(path))


def _plot_timeline(plt: Any, result: dict[str, Any], path: Path) -> None:
    tl = result.get("timeline") or {}
    modes = [m for m in ("async", "sync") if tl.get(m)]
    if not modes:
        return
    fig, axes = plt.subplots(len(modes), 1, figsize=(13, 2.4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        data = tl[mode]
        for s in data["host"]:
            ax.barh(
                1,
                s["end"] - s["start"],
                left=s["start"],
                color=PHASE_COLORS[s["phase"]],
                edgecolor="black" if s["phase"] == "wait" else None,
                lw=0.3,
                height=0.6,
            )
        for o in data["device"]:
            ax.barh(
                0,
                o["end"] - o["start"],
                left=o["start"],
                color=DEVICE_COLORS[o["kind"]],
                height=0.6,
                edgecolor="white",
                lw=0.3,
            )
        ax.set_yticks([0, 1], ["device", "host"])
        ax.set_xlabel("ms")
        ax.set_title(
            f"async {'on' if mode == 'async' else 'off'}: batch {tl['batch']}, "
            f"{tl['json_fraction']:.0%} JSON, steady steps"
        )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for c in [*PHASE_COLORS.values(), *DEVICE_COLORS.values()]
    ]
    names = [*PHASE_COLORS, *(f"device {k}" for k in DEVICE_COLORS)]
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
