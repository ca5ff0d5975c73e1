"""The report of ``baton bench serve_peers``: baton / llama-server per cell, the goals of the
quantised-weights work, a table and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.bench.common import fmt, judge_goal, print_goals, ratio
from baton.bench.plotting import pyplot
from baton.bench.tables import COMPACT, markdown_table

PEER = "llama-server"
RSS_SLACK_MIB = 300  # the memory goal: <= 1.25 x file + KV cache + 300 MB


def _cell(engine: dict[str, Any], mode: str, concurrency: int) -> dict[str, Any] | None:
    for c in engine["cells"]:
        if c["mode"] == mode and c["concurrency"] == concurrency:
            return c
    return None


def ratios(engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each baton engine / llama-server per cell: tok/s and (JSON) valid objects/s."""
    peer = next((e for e in engines if e["engine"] == PEER), None)
    if peer is None:
        return []
    out = []
    for e in engines:
        if e is peer:
            continue
        for c in e["cells"]:
            p = _cell(peer, c["mode"], c["concurrency"])
            if p is None:
                continue
            out.append(
                {
                    "engine": e["engine"],
                    "mode": c["mode"],
                    "concurrency": c["concurrency"],
                    "tok_per_s": ratio(c["tok_per_s"], p["tok_per_s"]),
                    "objects_per_s": ratio(c["objects_per_s"], p["objects_per_s"]),
                }
            )
    return out


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals that this run measures (per baton engine, judged on its worst cell)."""
    out = []
    by = {(r["engine"], r["mode"], r["concurrency"]): r for r in result["ratios"]}
    for e in result["engines"]:
        name = e["engine"]
        if name == PEER:
            continue
        free1 = by.get((name, "free", 1), {}).get("tok_per_s")
        json1 = by.get((name, "json", 1), {}).get("objects_per_s")
        json_n = {
            f"c{c}": by.get((name, "json", c), {}).get("objects_per_s")
            for c in result["config"]["concurrency"]
            if c >= 8
        }
        out.append(
            judge_goal(f"{name} free c1 tok/s / {PEER}", ">= 1.0", {"c1": free1}, "min", 1.0)
        )
        out.append(
            judge_goal(f"{name} JSON c1 objects/s / {PEER}", ">= 1.3", {"c1": json1}, "min", 1.3)
        )
        out.append(judge_goal(f"{name} JSON c>=8 objects/s / {PEER}", ">= 3", json_n, "min", 3.0))
        budget = 1.25 * result["model_file_mib"] + e["kv_cache_mib"] + RSS_SLACK_MIB
        out.append(
            judge_goal(
                f"{name} peak PSS / (1.25 file + KV + {RSS_SLACK_MIB} MiB)",
                "<= 1",
                {"peak": e["peak_pss_mib"] / budget},
                "max",
                1.0,
            )
        )
    return out


CELL_HEADER = (
    "engine",
    "mode",
    "conc",
    "tok/s",
    "objects/s",
    "valid",
    "TTFT p50 / p99 ms",
    "TPOT p50 ms",
    "vs llama-server (tok/s; objects/s)",
)
ENGINE_HEADER = (
    "engine",
    "load s",
    "PSS after load MiB",
    "peak PSS MiB",
    "KV cache MiB",
    "CPU variant",
)


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per engine and cell, then one per engine's load and memory."""
    by = {(r["engine"], r["mode"], r["concurrency"]): r for r in result["ratios"]}
    cells = []
    for e in result["engines"]:
        for c in e["cells"]:
            r = by.get((e["engine"], c["mode"], c["concurrency"]))
            vs = (
                "-"
                if r is None
                else f"{fmt(r['tok_per_s'], '.2f')}; {fmt(r['objects_per_s'], '.2f')}"
            )
            valid = "-" if c["valid_share"] is None else f"{c['valid_share']:.0%}"
            ttft = f"{fmt(c['ttft_p50_ms'], '.0f')} / {fmt(c['ttft_p99_ms'], '.0f')}"
            cells.append(
                [
                    str(e["engine"]),
                    str(c["mode"]),
                    str(c["concurrency"]),
                    f"{c['tok_per_s']:.1f}",
                    fmt(c["objects_per_s"], ".3f"),
                    valid,
                    ttft,
                    fmt(c["tpot_p50_ms"], ".1f"),
                    vs,
                ]
            )
    engines = [
        [
            str(e["engine"]),
            f"{e['load_s']:.1f}",
            f"{e['pss_after_load_mib']:.0f}",
            f"{e['peak_pss_mib']:.0f}",
            f"{e['kv_cache_mib']:.0f}",
            str(e["cpu_variant"] or "-"),
        ]
        for e in result["engines"]
    ]
    return (
        markdown_table(CELL_HEADER, cells, COMPACT)
        + "\n\n"
        + markdown_table(ENGINE_HEADER, engines, COMPACT)
    )


def print_report(result: dict[str, Any]) -> None:
    """Prints the table and the goals, and stores the goals in ``result``."""
    print(f"\nmodel {result['model']} ({result['model_file_mib']:.0f} MiB)")
    print(table(result))
    result["goals"] = goals(result)
    print_goals(result["goals"])


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars per cell: output tok/s (free) and valid objects/s (JSON), one colour per engine."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    concs = result["config"]["concurrency"]
    engines = result["engines"]
    width = 0.8 / max(1, len(engines))
    for ax, mode, key, label in (
        (axes[0], "free", "tok_per_s", "output tok/s"),
        (axes[1], "json", "objects_per_s", "valid JSON objects/s"),
    ):
        for i, e in enumerate(engines):
            ys = [(_cell(e, mode, c) or {}).get(key) or 0.0 for c in concs]
            xs = [j + i * width for j in range(len(concs))]
            ax.bar(xs, ys, width, label=e["engine"])
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(concs))])
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_title(f"{mode}: {label}")
        ax.legend()
    cpu = result.get("run", {}).get("cpu_model", "")
    fig.suptitle(f"{Path(result['model']).name}, 2 threads each; {cpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def readme_table(d: dict[str, Any]) -> str:
    """The README section's body: what ran, the tables, the goals."""
    from baton.bench.tables import goal_lines

    run = d.get("run", {})
    cfg = d["config"]
    caption = (
        f"`{Path(d['model']).name}` ({d['model_file_mib']:.0f} MiB), served over HTTP by each "
        f"engine in turn with {cfg['threads']} threads, on {run.get('cpu', 'an unnamed CPU')} "
        f"(commit {run.get('commit', '?')[:7]}; load average {d['load_avg'][0]:.1f} at the start, "
        f"{d['load_avg'][1]:.1f} at the end). Greedy streaming chat requests: free ones ignore "
        f"EOS and stop at "
        f"{cfg['free_tokens']} tokens; JSON ones follow the benchmark's person schema through "
        f"`response_format` (at most {cfg['json_tokens']} tokens); at least "
        f"{cfg['min_requests']} requests per cell (and one per client). A random-weight model "
        "measures weight-bound speed only, not output quality. llama-server's JSON is "
        "pretty-printed (more tokens per object): compare objects/s. PSS counts pages shared "
        "between an engine's processes once.\n\n"
    )
    return caption + table(d) + "\n\n" + "\n".join(goal_lines(d.get("goals") or []))
