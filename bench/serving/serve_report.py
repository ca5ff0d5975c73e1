"""The serve benchmark's report: the text table and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from baton.bench.common import fmt
from baton.bench.plotting import pyplot


def print_report(result: dict[str, Any]) -> None:
    """The per-level rows and the final engine metrics, as text."""
    print(
        f"model {result['model']} ({result['dtype']}), max_tokens {result['max_tokens']}, "
        f"{result['json_fraction']:.0%} JSON requests"
    )
    head = (
        f"{'conc':>4} {'done':>5} {'fail':>4} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'JSON ok':>8} {'cut':>4} {'steps':>6} {'defer':>5}"
    )
    print(head)
    for r in result["rows"]:
        json_ok = f"{r['json_valid']}/{r['json_checked']}"
        print(
            f"{r['concurrency']:>4} {r['done']:>5} {r['failed']:>4} "
            f"{fmt(r['tok_per_s'], '.1f'):>8} {fmt(r['ttft_p50_ms'], '.1f'):>9} "
            f"{fmt(r['ttft_p99_ms'], '.1f'):>9} {fmt(r['tpot_p50_ms'], '.2f'):>9} "
            f"{fmt(r['tpot_p99_ms'], '.2f'):>9} {json_ok:>8} {r['json_length_cut']:>4} "
            f"{r['engine_steps']:>6} {r['deferred_steps']:>5}"
        )
    print(
        "(times in ms, client-side; JSON ok = valid / JSON requests that stopped by themselves;"
        " cut = JSON requests cut by max_tokens, not judged)"
    )
    errors: dict[str, int] = {}
    for r in result["rows"]:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    if errors:
        print("errors: " + ", ".join(f"{k}: {n}" for k, n in sorted(errors.items())))
    m = result["metrics"]
    busy = m.get("baton_device_busy_fraction")
    print(
        f"server /metrics at the end: device busy {fmt(busy, '.1%')}, "
        f"steps {int(m.get('baton_engine_steps_total', 0))}, "
        f"deferred steps {int(m.get('baton_deferred_steps_total', 0))}"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    x = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, label in (
        (axes[0], "ttft", "TTFT (ms)"),
        (axes[1], "tpot", "TPOT (ms)"),
    ):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            y = [r[f"{metric}_{q}_ms"] for r in rows]
            y = [math.nan if v is None else v for v in y]
            ax.plot(x, y, style, label=q)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_title(f"{label.split()[0]} vs concurrency")
        ax.legend()
    axes[2].bar([str(c) for c in x], [r["tok_per_s"] or 0.0 for r in rows], color="tab:green")
    axes[2].set_xlabel("concurrent clients")
    axes[2].set_ylabel("output tokens / s")
    axes[2].set_title("throughput")
    fig.suptitle(
        f"baton serve: {result['model']}, {result['json_fraction']:.0%} JSON, "
        f"max_tokens {result['max_tokens']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
