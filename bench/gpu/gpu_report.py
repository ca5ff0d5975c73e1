"""The README's table of the prepared GPU check (``bench/results/gpu_check.json``): where it ran,
the GPU tests, async vs sync with the decode CUDA graphs and without them, and the paged
attention kernel."""

from __future__ import annotations

from typing import Any

from baton.bench.tables import goal_lines, markdown_table


def _rows_by_case(engine: dict[str, Any] | None) -> dict[tuple[int, float, bool], dict[str, Any]]:
    if not engine:
        return {}
    return {(r["batch"], r["json_fraction"], bool(r["async"])): r for r in engine["rows"]}


def _tok(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['tok_per_s']:.0f}"


def _tpot(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['tpot_ms']:.1f}"


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> str:
    """Returns ``num``'s tok/s over ``den``'s as two decimals, or "-" when either row is missing
    or the denominator is zero."""
    return f"{num['tok_per_s'] / den['tok_per_s']:.2f}" if num and den and den["tok_per_s"] else "-"


def _head(d: dict[str, Any], eager: bool) -> str:
    """Returns the check's opening paragraph: device and versions, commit and date, the stages,
    the GPU test counts, the model the engine runs used, and whether an eager run was made."""
    env, tests = d["env"], d.get("gpu_tests")
    stages = ", ".join(f"{s['stage']} {s['status']} ({s['seconds']:.0f} s)" for s in d["stages"])
    commit = (d.get("commit") or "unknown")[:12]
    head = (
        f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}; "
        f"code of commit `{commit}`, run {(d.get('run') or {}).get('date', '?')}. "
        f"Stages: {stages}."
    )
    if tests is not None:
        failing = f" (failing: {', '.join(tests['failing'])})" if tests["failing"] else ""
        head += (
            f" GPU tests: {tests['passed']} passed, {tests['failed']} failed, "
            f"{tests['errors']} errors, {tests['skipped']} skipped{failing}."
        )
    model = (
        "the default model"
        if env.get("default_model")
        else (
            "a random-weight model of SmolLM2-135M's shape (the default model's 98 MB do not "
            "travel to the GPU machine)"
        )
    )
    head += f" The engine runs use {model}, greedy, 64 tokens per request."
    if not eager:
        head += " No eager run in this check (graphs only)."
    return head


def _engine_table(engine: dict[str, Any]) -> str:
    """Returns the markdown table of the engine runs: one row per (batch, JSON fraction), the
    graphs run's async and sync columns, then the eager run's when there is one."""
    graphs = _rows_by_case(engine.get("graphs"))
    eager = _rows_by_case(engine.get("eager"))
    rows = []
    for batch, frac in sorted({(b, f) for b, f, _ in graphs} | {(b, f) for b, f, _ in eager}):
        g_on, g_off = graphs.get((batch, frac, True)), graphs.get((batch, frac, False))
        e_on, e_off = eager.get((batch, frac, True)), eager.get((batch, frac, False))
        row = [str(batch), f"{frac:.0%}", _tok(g_on), _tok(g_off), _ratio(g_on, g_off)]
        row.append(_tpot(g_on))
        rows.append(
            row + ([_tok(e_on), _tok(e_off), _tpot(e_on), _ratio(g_on, e_on)] if eager else [])
        )
    header = [
        "batch",
        "JSON",
        "graphs async tok/s",
        "graphs sync tok/s",
        "graphs async / sync",
        "graphs async TPOT ms",
    ]
    if eager:
        header += [
            "eager async tok/s",
            "eager sync tok/s",
            "eager async TPOT ms",
            "async: graphs / eager",
        ]
    return markdown_table(header, rows)


def _attention_line(d: dict[str, Any]) -> str | None:
    """Returns the sentence on the paged attention kernel's range of Triton-over-torch time
    ratios, or None when the check has no such rows."""
    attention = (d.get("paged_attention") or {}).get("rows") or []
    if not attention:
        return None
    ratios = [r["triton_over_engine"] for r in attention]
    return (
        f"Paged decode attention, Triton kernel over the torch path: "
        f"{min(ratios):.2f}-{max(ratios):.2f} of its time (batches "
        f"{min(r['batch'] for r in attention)}-{max(r['batch'] for r in attention)}, "
        f"contexts {min(r['context'] for r in attention)}-"
        f"{max(r['context'] for r in attention)})."
    )


def _launch_line(d: dict[str, Any]) -> str | None:
    """Returns the sentence on CUDA graph launch host times for the largest graph and the
    per-node slopes, or None when the check has no launch rows."""
    launch = d.get("graph_launch") or {}
    if not launch.get("rows"):
        return None
    slopes = launch.get("per_node_us") or {}
    biggest = max(launch["rows"], key=lambda r: r["nodes"])
    return (
        f"CUDA graph launch, host time (`bench/gpu/graph_launch.py`): {biggest['nodes']} nodes "
        + ", ".join(f"{s} {biggest[s]:.0f} us" for s in ("idle", "busy", "same", "other"))
        + "; per node: "
        + ", ".join(f"{s} {v:.2f} us" for s, v in slopes.items() if v is not None)
        + "."
    )


def gpu_check_table(d: dict[str, Any]) -> str:
    """Markdown for one GPU check: a line on where and what ran, the engine table (graphs and
    eager side by side), the goals the graphs run checks, and the attention kernel's range."""
    eager = bool(_rows_by_case(d["engine"].get("eager")))
    parts = [_head(d, eager), _engine_table(d["engine"])]
    goals = goal_lines((d["engine"].get("graphs") or {}).get("goals") or [], digits=3)
    if goals:
        parts.append("Goals of `baton bench engine`, graphs run:\n\n" + "\n".join(goals))
    parts += [line for line in (_attention_line(d), _launch_line(d)) if line is not None]
    return "\n\n".join(parts)
