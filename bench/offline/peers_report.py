"""The peers benchmark's report: ratios against each peer, the goals, the table and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.bench.common import fmt, ratio
from baton.bench.offline.peer_runners import ENGINES, GGUF_DTYPE, baton_label
from baton.bench.offline.peers_config import PeersConfig
from baton.bench.plotting import pyplot

# Goals of the issue: (peer, "high" = the highest concurrency measured or 1, minimum
# baton/peer output tokens/s). Targets, not measurements.
GOALS: tuple[tuple[str, str, float], ...] = (
    ("outlines", "high", 3.0),
    ("transformers", "high", 2.0),
    ("llama-cpp", "high", 2.0),
    ("transformers", "1", 1.2),
    ("llama-cpp", "1", 1.0),
)


def compute_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """baton / peer output tokens/s (and peer / baton TPOT) for every baton row against every
    peer row of the same concurrency and the same dtype (llama-cpp-python, which computes on
    the GGUF's own weights, against every baton row): above 1 means baton is faster."""
    out = []
    for b in (r for r in rows if r["engine"] == "baton"):
        for p in (
            r
            for r in rows
            if r["engine"] != "baton"
            and r["concurrency"] == b["concurrency"]
            and r["dtype"] in (b["dtype"], GGUF_DTYPE)
        ):
            out.append(
                {
                    "baton": b["label"],
                    "dtype": b["dtype"],
                    "peer": p["engine"],
                    "peer_label": p["label"],
                    "concurrency": b["concurrency"],
                    "tok_per_s_ratio": ratio(b["tok_per_s"], p["tok_per_s"]),
                    "tpot_speedup": ratio(p["tpot_ms"], b["tpot_ms"]),
                }
            )
    return out


def evaluate_goals(
    rows: list[dict[str, Any]], ratios: list[dict[str, Any]], cfg: PeersConfig
) -> list[dict[str, Any]]:
    """The issue's goals, judged on the baton row of the first dtype against its peers in the
    same dtype; the other dtypes' ratios are listed beside. Nothing is asserted."""
    ref = baton_label(cfg.dtypes[0])
    high = max(cfg.concurrency)
    goals = []
    for peer, at, target in GOALS:
        c = high if at == "high" else int(at)
        found = [r for r in ratios if r["peer"] == peer and r["concurrency"] == c]
        values = {r["baton"]: r["tok_per_s_ratio"] for r in found}
        value = values.get(ref)
        goals.append(
            {
                "goal": f"{ref} / {ENGINES[peer]} output tok/s at concurrency {c}",
                "target": f">= {target:g}",
                "threshold": target,
                "value": value,
                "met": None if value is None else value >= target,
                "values": values,
            }
        )
    return goals


def print_report(result: dict[str, Any]) -> None:
    """The table, the ratios, the goals and the skipped peers, as text."""
    print(
        f"\n{'engine':<32} {'conc':>4} {'tok/s':>8} {'spread':>13} {'TPOT ms':>8} "
        f"{'valid':>7} {'tok/req':>7}"
    )
    for r in result["rows"]:
        spread = f"{fmt(r['tok_per_s_min'], '.1f')}-{fmt(r['tok_per_s_max'], '.1f')}"
        print(
            f"{r['label']:<32} {r['concurrency']:>4} {fmt(r['tok_per_s'], '.1f'):>8} "
            f"{spread:>13} {fmt(r['tpot_ms'], '.1f'):>8} {fmt(r['valid_share'], '.0%'):>7} "
            f"{fmt(r['mean_output_tokens'], '.1f'):>7}"
        )
    if result["ratios"]:
        print("\nbaton / peer output tok/s (TPOT speed-up):")
        for q in result["ratios"]:
            print(
                f"  {q['baton']} / {q['peer_label']} at concurrency {q['concurrency']}: "
                f"{fmt(q['tok_per_s_ratio'], '.2f')} ({fmt(q['tpot_speedup'], '.2f')})"
            )
    print("\ngoals:")
    for g in result["goals"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        print(f"  [{verdict}] {g['goal']} {g['target']}: {fmt(g['value'], '.2f')}")
    for s in result["skipped"]:
        print(f"note: {s['label']} skipped: {s['reason']}")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = list(dict.fromkeys(r["label"] for r in result["rows"]))
    conc = result["concurrency"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / max(1, len(labels))
    panels = (
        ("tok_per_s", "output tokens / s", True),
        ("tpot_ms", "TPOT (ms)", True),
        ("valid_share", "share of outputs valid", False),
    )
    for ax, (key, name, log) in zip(axes, panels, strict=True):
        for i, label in enumerate(labels):
            values = [
                next(
                    (
                        r[key] or 0.0
                        for r in result["rows"]
                        if r["label"] == label and r["concurrency"] == c
                    ),
                    0.0,
                )
                for c in conc
            ]
            ax.bar(
                [j + (i - (len(labels) - 1) / 2) * width for j in range(len(conc))],
                values,
                width,
                label=label,
            )
        ax.set_xticks(range(len(conc)), [f"concurrency {c}" for c in conc])
        ax.set_ylabel(name)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0.0, 1.05)
    axes[0].legend(fontsize=8)
    skipped = ", ".join(s["label"] for s in result["skipped"])
    fig.suptitle(
        f"JSON-schema workload, greedy, <= {result['max_tokens']} tokens"
        + (f" (skipped: {skipped})" if skipped else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
