"""Mask fill time per row, per schema feature family, for every grammar backend.

The real schemas and instances of the data directory (maskbench files) are compiled by each
backend in worker processes (as ``baton bench grammar`` does: time-outs and crashes are
recorded, the run goes on; schemas compile with ``allow_unenforced`` unless
``--enforced-only``); each instance, its keys put in the schema's declared order (the
order both backends generate), is walked token by token with ``--rows`` matchers side by
side, and before each token the bitmask of all rows is filled with the backend's batched call,
as the engine fills a batch. Every state is put in the feature families it stands inside
(``bench/grammars/mask_families.py``: bounded strings, patterns, formats, enums and consts, nested
objects, array bounds, anyOf/oneOf, deep $ref; "plain" for none) and its fill time per row
goes to each. Reports p50/p99/max per family and backend, the 10 schemas with the slowest
state per backend (named, with the text before that state), and the goal: p99 <= 200 us per
row on every family with xgrammar. Writes JSON, a CSV (one row per schema x backend) and a
PNG.

    baton bench masks [--data PATH ...] [--backends xgrammar,outlines,guidance] [--rows 16]
        [--fill-repeats 3] [--enforced-only] [--limit N] [--timeout 30] [--jobs 1]
        [--out bench/results/masks.json]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baton.bench import common
from baton.bench.grammars.grammar import (
    BACKENDS,
    RESULTS,
    GrammarBenchConfig,
    build_parser,
    config_from_args,
    load_cases,
    load_model_tokenizer,
)
from baton.bench.grammars.grammar_runner import TaskRecord, run_tasks
from baton.bench.grammars.grammar_worker import (
    BackendFactory,
    SchemaCase,
    Task,
    TestInstance,
    WorkerConfig,
    fed_as_written,
    serialize_instance,
)
from baton.bench.grammars.mask_families import FAMILIES, PLAIN, state_families
from baton.bench.plotting import pyplot
from baton.grammar.vocab import VocabSource, build_vocab

DEFAULT_OUT = RESULTS / "masks.json"
GOAL_BACKEND = "xgrammar"
GOAL_P99_US = 200.0
WORST = 10
ALL = "all states"
CSV_COLUMNS = (
    "schema",
    "backend",
    "status",
    "error",
    "compile_ms",
    "states",
    "fill_us_p50",
    "fill_us_p99",
    "fill_us_max",
    "worst_families",
    "worst_before",
)
_CONTEXT_CHARS = 48


@dataclass(frozen=True)
class MaskBenchConfig:
    """What to run: the grammar benchmark's settings, the rows filled per state, the fills
    timed per state (the fastest kept), and whether schemas compile with ``allow_unenforced``
    (the default: a keyword a backend ignores does not hide the fill times of the rest of its
    grammar).

    Raises:
        ValueError: rows is not an int >= 1.
    """

    run: GrammarBenchConfig
    rows: int = 16
    allow_unenforced: bool = True
    fill_repeats: int = 3

    def __post_init__(self) -> None:
        common.require_positive_ints(self, "rows", "fill_repeats")


@dataclass(frozen=True)
class _State:
    """One filled state: per-row fill time, families, where it was."""

    us: float
    families: frozenset[str]
    test: int
    token: int


def schema_ordered(case: SchemaCase) -> SchemaCase:
    """The case with each test as the worker feeds it (``fed_as_written``: keys in its
    schema's declared property order, integral numbers without a fraction), so that the
    states labelled here are the states the worker walked."""
    tests = tuple(
        dataclasses.replace(t, data=fed_as_written(case.schema, t.data)) for t in case.tests
    )
    return dataclasses.replace(case, tests=tests)


def _tokens(tokenizer: VocabSource, test: TestInstance, whitespace: str) -> tuple[list[int], str]:
    text = serialize_instance(test.data, whitespace)  # type: ignore[arg-type]
    return tokenizer.encode(text, add_special_tokens=False), text  # type: ignore[attr-defined]


def record_states(
    record: TaskRecord,
    tokenizer: VocabSource,
    token_bytes: Sequence[bytes],
    whitespace: str,
) -> list[_State]:
    """The labelled fill times of every state the task's walks reached."""
    states: list[_State] = []
    case = record.task.case
    for index, (test, outcome) in enumerate(zip(case.tests, record.instances, strict=False)):
        times = outcome["mask_us"]
        if outcome["error"] or not times:
            continue
        tokens, _ = _tokens(tokenizer, test, whitespace)
        lengths = [len(token_bytes[t]) for t in tokens]
        families = state_families(case.schema, test.data, whitespace, lengths)
        # A walk stops at its first rejected token: it reached len(times) states.
        for i, us in enumerate(times):
            states.append(_State(float(us), families[i], index, i))
    return states


def _context(
    record: TaskRecord,
    state: _State,
    tokenizer: VocabSource,
    token_bytes: Sequence[bytes],
    whitespace: str,
) -> str:
    """The end of the text accepted before ``state``."""
    test = record.task.case.tests[state.test]
    tokens, _ = _tokens(tokenizer, test, whitespace)
    before = b"".join(token_bytes[t] for t in tokens[: state.token])
    text = before.decode("utf-8", errors="replace")
    return ("..." if len(text) > _CONTEXT_CHARS else "") + text[-_CONTEXT_CHARS:]


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"states": 0, "p50": None, "p99": None, "max": None}
    p50, p99 = np.percentile(arr, [50, 99])
    return {"states": int(arr.size), "p50": float(p50), "p99": float(p99), "max": float(arr.max())}


def family_summary(per_schema: Mapping[str, Sequence[_State]]) -> dict[str, dict[str, Any]]:
    """Per family (and "plain", and all states): states, schemas, p50/p99/max µs per row,
    and the schema holding the slowest state."""
    out: dict[str, dict[str, Any]] = {}
    for family in (*FAMILIES, PLAIN, ALL):
        values: list[float] = []
        schemas = 0
        worst: tuple[float, str] | None = None
        for schema, states in per_schema.items():
            mine = [
                s.us
                for s in states
                if family == ALL or family in s.families or (family == PLAIN and not s.families)
            ]
            if not mine:
                continue
            schemas += 1
            values += mine
            top = max(mine)
            if worst is None or top > worst[0]:
                worst = (top, schema)
        out[family] = {
            **_stats(values),
            "schemas": schemas,
            "worst_schema": None if worst is None else worst[1],
        }
    return out


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("xgrammar", "outlines-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


@dataclass(frozen=True)
class _BackendSummary:
    rows: list[dict[str, Any]]  # one per schema
    families: dict[str, Any]  # family_summary
    worst: list[dict[str, Any]]  # the slowest rows' schemas, families and context
    compiled: dict[str, int]  # schemas, compiled, timeouts, crashes, states


def _backend_summary(
    backend: str,
    mine: list[TaskRecord],
    tokenizer: VocabSource,
    token_bytes: Any,
    whitespace: str,
) -> _BackendSummary:
    """One backend's records as the result's rows, family summary, worst rows and counts."""
    rows: list[dict[str, Any]] = []
    per_schema: dict[str, list[_State]] = {}
    slowest: list[tuple[float, TaskRecord, _State]] = []
    for record in mine:
        states = record_states(record, tokenizer, token_bytes, whitespace)
        stats = _stats([s.us for s in states])
        row: dict[str, Any] = {
            "schema": record.task.case.id,
            "backend": backend,
            "status": record.status,
            "error": record.error,
            "compile_ms": None if record.compile_s is None else record.compile_s * 1e3,
            "states": stats["states"],
            "fill_us_p50": stats["p50"],
            "fill_us_p99": stats["p99"],
            "fill_us_max": stats["max"],
            "worst_families": None,
            "worst_before": None,
        }
        if states:
            per_schema[record.task.case.id] = states
            top = max(states, key=lambda s: s.us)
            row["worst_families"] = sorted(top.families) or [PLAIN]
            slowest.append((top.us, record, top))
        rows.append(row)
    slowest.sort(key=lambda x: -x[0])
    worst = []
    for us, record, state in slowest[:WORST]:
        before = _context(record, state, tokenizer, token_bytes, whitespace)
        worst.append(
            {
                "schema": record.task.case.id,
                "max_us": us,
                "families": sorted(state.families) or [PLAIN],
                "before": before,
            }
        )
        for row in rows:
            if row["schema"] == record.task.case.id:
                row["worst_before"] = before
    compiled = {
        "schemas": len(mine),
        "compiled": sum(1 for r in mine if r.compiled),
        "timeouts": sum(1 for r in mine if r.status == "timeout"),
        "crashes": sum(1 for r in mine if r.status in ("crash", "oom")),
        "states": sum(len(s) for s in per_schema.values()),
    }
    return _BackendSummary(rows, family_summary(per_schema), worst, compiled)


def _goals(
    families: dict[str, dict[str, Any]], worst: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The goal line: the goal backend's worst family p99 per row against GOAL_P99_US."""
    if GOAL_BACKEND not in families:
        return []
    p99s = [
        (families[GOAL_BACKEND][f]["p99"], f)
        for f in FAMILIES
        if families[GOAL_BACKEND][f]["p99"] is not None
    ]
    value, family = max(p99s) if p99s else (None, None)
    top = worst[GOAL_BACKEND][0] if worst[GOAL_BACKEND] else None
    return [
        {
            "goal": f"{GOAL_BACKEND} mask fill p99 per row, worst family ({family}),",
            "target": f"<= {GOAL_P99_US:g} us",
            "value": value,
            "met": value is not None and value <= GOAL_P99_US,
            "worst_schema": None if top is None else top["schema"],
            "worst_schema_us": None if top is None else top["max_us"],
        }
    ]


def run_masks(
    config: MaskBenchConfig,
    *,
    tokenizer: VocabSource | None = None,
    vocab_size: int | None = None,
    factories: Mapping[str, BackendFactory] | None = None,
) -> dict[str, Any]:
    """Runs the benchmark and returns the result; writes nothing.

    Args:
        config: what to run.
        tokenizer, vocab_size: use these instead of loading ``config.run.tokenizer`` (both or
            neither).
        factories: backend name -> factory (default ``BACKENDS``).

    Raises:
        ValueError: bad data, an unknown backend name, or an unreadable tokenizer.
        RuntimeError: a worker could not start.
    """
    run = config.run
    factories = dict(BACKENDS if factories is None else factories)
    unknown = [b for b in run.backends if b not in factories]
    if unknown:
        raise ValueError(
            f"unknown backend(s) {', '.join(unknown)}; expected some of {', '.join(factories)}"
        )
    if (tokenizer is None) != (vocab_size is None):
        raise ValueError("give both tokenizer and vocab_size, or neither")
    cases = [schema_ordered(c) for c in load_cases(run.data, run.limit)]
    model = "given"
    if tokenizer is None:
        tokenizer, vocab_size, model = load_model_tokenizer(run.tokenizer)
    assert vocab_size is not None
    token_bytes = build_vocab(tokenizer).token_bytes
    max_bytes = None if run.max_memory_gb is None else int(run.max_memory_gb * 2**30)
    worker_config = WorkerConfig(
        tokenizer,
        vocab_size,
        {name: factories[name] for name in run.backends},
        run.whitespace,
        max_bytes,
        rows=config.rows,
        allow_unenforced=config.allow_unenforced,
        fill_repeats=config.fill_repeats,
    )
    tasks = [Task(case, backend) for case in cases for backend in run.backends]
    load_avg = list(os.getloadavg())  # before the run, not what the run adds
    t0 = time.perf_counter()
    records = run_tasks(tasks, worker_config, run.timeout_s, run.jobs, run.progress)
    wall_s = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    families: dict[str, dict[str, Any]] = {}
    worst: dict[str, list[dict[str, Any]]] = {}
    compiled: dict[str, dict[str, int]] = {}
    for backend in run.backends:
        mine = [r for r in records if r.task.backend == backend]
        summary = _backend_summary(backend, mine, tokenizer, token_bytes, run.whitespace)
        rows += summary.rows
        families[backend], worst[backend], compiled[backend] = (
            summary.families,
            summary.worst,
            summary.compiled,
        )
    goals = _goals(families, worst)
    return {
        "config": _config_record(config, cases, model, vocab_size, load_avg, wall_s),
        "compiled": compiled,
        "families": families,
        "worst": worst,
        "goals": goals,
        "rows": rows,
    }


def _config_record(
    config: MaskBenchConfig,
    cases: list[Any],
    model: str,
    vocab_size: int,
    load_avg: list[float],
    wall_s: float,
) -> dict[str, Any]:
    """The result's "config": what ran, on what, the load before it, and how long it took."""
    run = config.run
    return {
        "data": [str(p) for p in run.data],
        "schemas": len(cases),
        "tests": sum(len(c.tests) for c in cases),
        "backends": list(run.backends),
        "rows": config.rows,
        "allow_unenforced": config.allow_unenforced,
        "fill_repeats": config.fill_repeats,
        "tokenizer": model,
        "vocab_size": vocab_size,
        "whitespace": run.whitespace,
        "limit": run.limit,
        "timeout_s": run.timeout_s,
        "jobs": run.jobs,
        "load_avg": load_avg,
        "versions": _versions(),
        "wall_s": wall_s,
    }


# ---------------------------------------------------------------------------------- output


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_report(result: Mapping[str, Any]) -> str:
    """Per family p50/p99/max µs per row for each backend, then the worst schemas."""
    names = list(result["families"])
    lines = [f"{'family':<18}" + "".join(f"{n + ' p50/p99/max us (states)':>44}" for n in names)]
    for family in (*FAMILIES, PLAIN, ALL):
        cells = []
        for n in names:
            s = result["families"][n][family]
            cells.append(
                f"{_num(s['p50'])}/{_num(s['p99'])}/{_num(s['max'])} ({s['states']})".rjust(44)
            )
        lines.append(f"{family:<18}" + "".join(cells))
    for n in names:
        lines.append(f"\nslowest states, {n}:")
        for w in result["worst"][n]:
            lines.append(
                f"  {w['max_us']:10.1f} us  {w['schema']}  [{', '.join(w['families'])}]  "
                f"after {w['before']!r}"
            )
    for g in result["goals"]:
        verdict = "met" if g["met"] else "MISSED"
        lines.append(f"\n{verdict}: {g['goal']} {g['target']}: {_num(g['value'])}")
    cfg = result["config"]
    lines.append(
        f"\n{cfg['schemas']} schemas, {cfg['tests']} tests, {cfg['rows']} rows per fill, "
        f"{cfg['wall_s']:.1f} s wall"
    )
    return "\n".join(lines)


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """One CSV row per schema x backend (``CSV_COLUMNS``)."""
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            fams = row["worst_families"]
            writer.writerow({**row, "worst_families": " ".join(fams) if fams else ""})


def plot(result: Mapping[str, Any], path: Path) -> None:
    """Per family: p99 per row (bar) and max (marker) for each backend, log scale, with the
    goal line."""
    plt = pyplot()
    if plt is None:
        return
    names = list(result["families"])
    labels = [*FAMILIES, PLAIN, ALL]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    height = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        ys = [i + (k - (len(names) - 1) / 2) * height for i in range(len(labels))]
        fam = result["families"][name]
        p99 = [fam[f]["p99"] or 0.0 for f in labels]
        mx = [fam[f]["max"] or 0.0 for f in labels]
        p50 = [fam[f]["p50"] or 0.0 for f in labels]
        bars = ax.barh(ys, p99, height, label=f"{name} p99")
        color = bars.patches[0].get_facecolor() if bars.patches else None
        ax.scatter(mx, ys, marker="|", s=120, color=color, label=f"{name} max")
        ax.scatter(p50, ys, marker=".", s=40, color="black")
    ax.axvline(GOAL_P99_US, color="red", linestyle="--", label=f"goal p99 {GOAL_P99_US:g} us")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"mask fill time per row, {result['config']['rows']} rows at once (µs)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    cfg = result["config"]
    ax.set_title(f"mask fill per feature family: {cfg['schemas']} schemas (dots: p50)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: dict[str, Any], out: Path) -> None:
    """Writes ``out`` (JSON, with the run's provenance), the CSV and the PNG beside it."""
    common.write_results(result, out, plot)
    write_csv(result["rows"], out.with_suffix(".csv"))


# ------------------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    """``baton bench grammar``'s arguments, plus ``--rows``, writing masks.json by default."""
    p = build_parser()
    p.prog = "baton bench masks"
    p.description = __doc__.splitlines()[0]
    # Every backend by default: the point is to find a slow rule shape in any of them.
    p.set_defaults(out=DEFAULT_OUT, backends=tuple(BACKENDS))
    p.add_argument(
        "--rows", type=int, default=16, help="matchers filled together per state (default: 16)"
    )
    p.add_argument(
        "--fill-repeats",
        type=int,
        default=3,
        help="fills timed per state, the fastest kept, so that preemption on a loaded host "
        "does not read as a slow state (default: 3)",
    )
    p.add_argument(
        "--enforced-only",
        action="store_true",
        help="refuse schemas with keywords a backend ignores, as a default request does "
        "(default: compile them with allow_unenforced)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs ``baton bench masks``: prints the report, writes JSON, CSV and PNG.

    Exits through argparse (SystemExit 2) on a bad argument.
    """
    p = parser()
    a = p.parse_args(argv)
    try:
        config = MaskBenchConfig(
            config_from_args(p, a),
            rows=a.rows,
            allow_unenforced=not a.enforced_only,
            fill_repeats=a.fill_repeats,
        )
    except ValueError as exc:
        p.error(str(exc))
    result = run_masks(config)
    print(format_report(result))
    write_results(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
