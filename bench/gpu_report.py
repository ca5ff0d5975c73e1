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


def gpu_check_table(d: dict[str, Any]) -> str:
    """Markdown for one GPU check: a line on where and what ran, the engine table (graphs and
    eager side by side), the goals the graphs run checks, and the attention kernel's range."""
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
    graphs = _rows_by_case(d["engine"].get("graphs"))
    eager = _rows_by_case(d["engine"].get("eager"))
    if not eager:
        head += " No eager run in this check (graphs only)."
    rows = []
    for batch, frac in sorted({(b, f) for b, f, _ in graphs} | {(b, f) for b, f, _ in eager}):
        g_on, g_off = graphs.get((batch, frac, True)), graphs.get((batch, frac, False))
        e_on, e_off = eager.get((batch, frac, True)), eager.get((batch, frac, False))
        speedup = (
            f"{g_on['tok_per_s'] / e_on['tok_per_s']:.2f}"
            if g_on and e_on and e_on["tok_per_s"]
            else "-"
        )
        ratio = (
            f"{g_on['tok_per_s'] / g_off['tok_per_s']:.2f}"
            if g_on and g_off and g_off["tok_per_s"]
            else "-"
        )
        row = [str(batch), f"{frac:.0%}", _tok(g_on), _tok(g_off), ratio, _tpot(g_on)]
        rows.append(row + ([_tok(e_on), _tok(e_off), _tpot(e_on), speedup] if eager else []))
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
    goals = goal_lines((d["engine"].get("graphs") or {}).get("goals") or [], digits=3)
    parts = [head, markdown_table(header, rows)]
    if goals:
        parts.append("Goals of `baton bench engine`, graphs run:\n\n" + "\n".join(goals))
    attention = (d.get("paged_attention") or {}).get("rows") or []
    if attention:
        ratios = [r["triton_over_engine"] for r in attention]
        parts.append(
            f"Paged decode attention, Triton kernel over the torch path: "
            f"{min(ratios):.2f}-{max(ratios):.2f} of its time (batches "
            f"{min(r['batch'] for r in attention)}-{max(r['batch'] for r in attention)}, "
            f"contexts {min(r['context'] for r in attention)}-"
            f"{max(r['context'] for r in attention)})."
        )
    launch = d.get("graph_launch") or {}
    if launch.get("rows"):
        slopes = launch.get("per_node_us") or {}
        biggest = max(launch["rows"], key=lambda r: r["nodes"])
        parts.append(
            f"CUDA graph launch, host time (`bench/graph_launch.py`): {biggest['nodes']} nodes "
            + ", ".join(f"{s} {biggest[s]:.0f} us" for s in ("idle", "busy", "same", "other"))
            + "; per node: "
            + ", ".join(f"{s} {v:.2f} us" for s, v in slopes.items() if v is not None)
            + "."
        )
    return "\n\n".join(parts)
