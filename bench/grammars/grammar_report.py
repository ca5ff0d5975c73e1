"""The grammar benchmark's results: one row per schema and backend, the "auto" rows derived
from its backends' as the engine's fallback works, the summary per backend in MaskBench's terms,
mask-time CDFs, the text table, the CSV and the plot.

A valid instance rejected only because of baton's closed-object policy (it has a property its
schema does not declare: invalid against the schema as ``close_object_schemas`` reads it,
valid against the schema itself, both checked with ``jsonschema``) counts as "policy", apart
from the real misses ("valid rejected"); it does not make a schema fail.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from baton.bench.grammars.grammar_runner import TaskRecord
from baton.bench.plotting import pyplot
from baton.grammar.schema.normalise import close_object_schemas
from baton.grammar.spec import AUTO_ORDER

CDF_PERCENTILES = np.linspace(0.0, 100.0, 201)
CSV_COLUMNS = (
    "schema",
    "mode",
    "backend",
    "served_by",
    "status",
    "error_kind",
    "error",
    "compiled",
    "compile_ms",
    "tests",
    "tests_run",
    "valid_tests",
    "invalid_tests",
    "valid_rejected",
    "policy_rejected",
    "invalid_accepted",
    "instance_errors",
    "tokens",
    "mask_us_avg",
    "mask_us_p50",
    "mask_us_p99",
    "mask_us_max",
    "mask_mismatches",
    "passing",
    "failures",
)
_MAX_FAILURES_LISTED = 5


# ------------------------------------------------------------------------------ the results


def _stats(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """avg, p50, p99 and max (None each when there are no values)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"avg": None, "p50": None, "p99": None, "max": None}
    p50, p99 = np.percentile(arr, [50, 99])
    return {"avg": float(arr.mean()), "p50": float(p50), "p99": float(p99), "max": float(arr.max())}


def policy_only(schema: Any, data: Any) -> bool:
    """Whether ``data`` is valid against ``schema`` but not against it with closed objects
    (``close_object_schemas``): a rejection due to baton's policy, not a miss. False when
    ``jsonschema`` cannot decide (an unresolvable reference, say)."""
    from jsonschema.validators import Draft202012Validator, validator_for

    try:
        closed = close_object_schemas(schema)
        as_written = validator_for(schema, default=Draft202012Validator)(schema)
        as_closed = validator_for(closed, default=Draft202012Validator)(closed)
        return as_written.is_valid(data) and not as_closed.is_valid(data)
    except Exception:  # noqa: BLE001 - jsonschema raises several kinds on odd schemas
        return False


def record_row(record: TaskRecord, mode: str = "strict") -> tuple[dict[str, Any], np.ndarray]:
    """The result row of one task (CSV-ready scalars, plus a "failures" list) and its mask
    times per token (µs); ``mode``: "strict", or "lenient" (compiled with allow_unenforced)."""
    times = np.asarray([t for inst in record.instances for t in inst["mask_us"]], dtype=np.float64)
    case = record.task.case
    # Instances come back in the order of the case's tests.
    policy = {
        k
        for k, i in enumerate(record.instances)
        if i["valid"]
        and not i["accepted"]
        and not i["error"]
        and policy_only(case.schema, case.tests[k].data)
    }
    wrong = [
        i
        for k, i in enumerate(record.instances)
        if (i["accepted"] != i["valid"] or i["error"]) and k not in policy
    ]
    valid_run = sum(1 for i in record.instances if i["valid"])
    valid_rejected = sum(1 for i in record.instances if i["valid"] and not i["accepted"])
    invalid_accepted = sum(1 for i in record.instances if not i["valid"] and i["accepted"])
    stats = _stats(times)
    failures = [
        f"{'valid' if i['valid'] else 'invalid'} {'accepted' if i['accepted'] else 'rejected'}: "
        f"{i['description']}" + (f" [{i['error']}]" if i["error"] else "")
        for i in wrong[:_MAX_FAILURES_LISTED]
    ]
    failures += [
        f"valid rejected (closed-object policy): {record.instances[k]['description']}"
        for k in sorted(policy)[: max(0, _MAX_FAILURES_LISTED - len(failures))]
    ]
    row = {
        "schema": case.id,
        "mode": mode,
        "backend": record.task.backend,
        "served_by": record.task.backend,
        "status": record.status,
        "error_kind": record.error_kind,
        "error": record.error,
        "compiled": record.compiled,
        "compile_ms": None if record.compile_s is None else record.compile_s * 1e3,
        "tests": len(case.tests),
        "tests_run": len(record.instances),
        "valid_tests": valid_run,
        "invalid_tests": len(record.instances) - valid_run,
        "valid_rejected": valid_rejected - len(policy),
        "policy_rejected": len(policy),
        "invalid_accepted": invalid_accepted,
        "instance_errors": sum(1 for i in record.instances if i["error"]),
        "tokens": int(times.size),
        "mask_us_avg": stats["avg"],
        "mask_us_p50": stats["p50"],
        "mask_us_p99": stats["p99"],
        "mask_us_max": stats["max"],
        "mask_mismatches": sum(i["mismatches"] for i in record.instances),
        "passing": record.status == "ok" and not wrong,
        "failures": failures,
    }
    return row, times


def auto_rows(
    rows: Sequence[dict[str, Any]], times: Mapping[tuple[str, str], np.ndarray]
) -> tuple[list[dict[str, Any]], dict[tuple[str, str], np.ndarray]]:
    """Rows of "auto", derived from the per-backend rows as the engine's fallback works: the
    backends of ``AUTO_ORDER`` in turn; one that compiled serves the schema; one that cannot
    take it (unsupported, compile error, MemoryError: all raised in the compile service) passes
    to the next, its compile attempt adding to the compile time; a time-out or crash ends the
    request (the engine does not fall back then; a crash would end the engine).
    Schemas missing a backend of ``AUTO_ORDER`` get no auto row."""
    by_schema: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_schema.setdefault(row["schema"], {})[row["backend"]] = row
    out: list[dict[str, Any]] = []
    out_times: dict[tuple[str, str], np.ndarray] = {}
    for schema, per_backend in by_schema.items():
        if not all(name in per_backend for name in AUTO_ORDER):
            continue
        spent_ms = 0.0
        errors = []
        chosen: dict[str, Any] | None = None
        for name in AUTO_ORDER:
            row = per_backend[name]
            if row["status"] in ("compile_error", "oom"):
                spent_ms += row["compile_ms"] or 0.0
                errors.append(f"{name}: {row['error']}")
                continue
            chosen = row
            break
        if chosen is None:
            last = per_backend[AUTO_ORDER[-1]]
            auto = {**last, "served_by": None, "error": "; ".join(errors)}
            auto["compile_ms"] = spent_ms if last["compile_ms"] is not None else None
        else:
            auto = dict(chosen)
            if chosen["compile_ms"] is not None:
                auto["compile_ms"] = chosen["compile_ms"] + spent_ms
            out_times[(schema, "auto")] = times.get((schema, chosen["backend"]), np.empty(0))
        auto["backend"] = "auto"
        out.append(auto)
    return out, out_times


def summarize(
    rows: Sequence[dict[str, Any]], times: Mapping[tuple[str, str], np.ndarray], backend: str
) -> dict[str, Any]:
    """MaskBench's per-backend figures over ``backend``'s rows.

    Keys: schemas, compiled, passing, passing_pct, compile_errors (of which unsupported,
    invalid_schema: rejected at submission), timeouts, crashes (oom included), oom,
    timeouts_crashes, tests_run, valid_tests, invalid_tests, valid_rejected (real misses),
    policy_rejected (valid instances rejected only by the closed-object policy),
    invalid_accepted, instance_errors, tokens, mask_mismatches, compile_ms and mask_us
    ({avg, p50, p99, max}).
    """
    mine = [r for r in rows if r["backend"] == backend]
    status = Counter(r["status"] for r in mine)
    kinds = Counter(r["error_kind"] for r in mine if r["status"] == "compile_error")
    mask = [times[(r["schema"], backend)] for r in mine if (r["schema"], backend) in times]
    all_times = np.concatenate(mask) if mask else np.empty(0)
    crashes = status["crash"] + status["oom"]
    passing = sum(1 for r in mine if r["passing"])
    return {
        "schemas": len(mine),
        "compiled": sum(1 for r in mine if r["compiled"]),
        "passing": passing,
        "passing_pct": 100.0 * passing / len(mine) if mine else None,
        "compile_errors": status["compile_error"],
        "unsupported": kinds["unsupported"],
        "invalid_schema": kinds["invalid"],
        "timeouts": status["timeout"],
        "crashes": crashes,
        "oom": status["oom"],
        "timeouts_crashes": status["timeout"] + crashes,
        "tests_run": sum(r["tests_run"] for r in mine),
        "valid_tests": sum(r["valid_tests"] for r in mine),
        "invalid_tests": sum(r["invalid_tests"] for r in mine),
        "valid_rejected": sum(r["valid_rejected"] for r in mine),
        "policy_rejected": sum(r.get("policy_rejected", 0) for r in mine),
        "invalid_accepted": sum(r["invalid_accepted"] for r in mine),
        "instance_errors": sum(r["instance_errors"] for r in mine),
        "tokens": int(all_times.size),
        "mask_mismatches": sum(r["mask_mismatches"] for r in mine),
        "compile_ms": _stats([r["compile_ms"] for r in mine if r["compiled"]]),
        "mask_us": _stats(all_times),
    }


def mask_cdf(times: np.ndarray) -> dict[str, list[float]]:
    """The CDF of mask times as percentiles (0, 0.5, ..., 100) and their values (µs)."""
    if times.size == 0:
        return {"p": [], "us": []}
    return {
        "p": [float(p) for p in CDF_PERCENTILES],
        "us": [float(v) for v in np.percentile(times, CDF_PERCENTILES)],
    }


# ---------------------------------------------------------------------------------- output


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_report(result: Mapping[str, Any]) -> str:
    """The summary as a text table, one column per backend."""
    summary = result["summary"]
    names = list(summary)

    def line(label: str, cell: Any) -> str:
        return f"{label:<28}" + "".join(f"{cell(summary[n]):>24}" for n in names)

    def triple(key: str) -> Any:
        return lambda s: "/".join(_num(s[key][k]) for k in ("avg", "p50", "p99"))

    lines = [
        f"{'':<28}" + "".join(f"{n:>24}" for n in names),
        line("schemas", lambda s: str(s["schemas"])),
        line("compiled", lambda s: str(s["compiled"])),
        line("passing", lambda s: f"{s['passing']} ({_num(s['passing_pct'])}%)"),
        line("compile errors", lambda s: str(s["compile_errors"])),
        line("  of which unsupported", lambda s: str(s["unsupported"])),
        line("  of which invalid schema", lambda s: str(s["invalid_schema"])),
        line("time-outs / crashes", lambda s: f"{s['timeouts']} / {s['crashes']}"),
        line("valid rejected", lambda s: f"{s['valid_rejected']} of {s['valid_tests']}"),
        line("  closed-object policy", lambda s: str(s.get("policy_rejected", 0))),
        line("invalid accepted", lambda s: f"{s['invalid_accepted']} of {s['invalid_tests']}"),
        line("walk errors", lambda s: str(s["instance_errors"])),
        line("compile ms avg/p50/p99", triple("compile_ms")),
        line("mask us/token avg/p50/p99", triple("mask_us")),
        line("tokens", lambda s: str(s["tokens"])),
        line("mask/accept mismatches", lambda s: str(s["mask_mismatches"])),
    ]
    cfg = result["config"]
    lines.append(
        f"\n{cfg['schemas']} schemas, {cfg['tests']} tests, {cfg['jobs']} job(s), "
        f"time-out {cfg['timeout_s']:g} s, {cfg['wall_s']:.1f} s wall"
    )
    if "lenient" in result:
        lines += ["", format_lenient(result["lenient"])]
    return "\n".join(lines)


def format_lenient(lenient: Mapping[str, Any]) -> str:
    """The lenient part as a text table: the schemas refused as unsupported, compiled again
    with ``allow_unenforced``."""
    summary = lenient["summary"]
    names = list(summary)

    def line(label: str, cell: Any) -> str:
        return f"{label:<28}" + "".join(f"{cell(summary[n]):>24}" for n in names)

    return "\n".join(
        [
            "lenient (allow_unenforced) on the schemas refused as unsupported:",
            f"{'':<28}" + "".join(f"{n:>24}" for n in names),
            line("schemas refused", lambda s: str(s["schemas"])),
            line("compiled lenient", lambda s: str(s["compiled"])),
            line("still unsupported", lambda s: str(s["unsupported"])),
            line("time-outs / crashes", lambda s: f"{s['timeouts']} / {s['crashes']}"),
            line("invalid accepted", lambda s: f"{s['invalid_accepted']} of {s['invalid_tests']}"),
            line("valid rejected", lambda s: f"{s['valid_rejected']} of {s['valid_tests']}"),
            line("  closed-object policy", lambda s: str(s["policy_rejected"])),
            line("mask/accept mismatches", lambda s: str(s["mask_mismatches"])),
        ]
    )


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """One CSV row per schema x backend (``CSV_COLUMNS``; failures joined by " | ")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "failures": " | ".join(row["failures"])})


def plot(result: Mapping[str, Any], path: Path) -> None:
    """CDFs of mask time per token and of compile time, one line per backend, as a PNG."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, cdf in result["mask_us_cdf"].items():
        if cdf["us"]:
            left.plot(cdf["us"], [p / 100 for p in cdf["p"]], label=name)
    left.set_xscale("log")
    left.set_xlabel("mask time per token (µs)")
    left.set_ylabel("fraction of tokens")
    left.set_title("bitmask fill time per token")
    for name in result["summary"]:
        ms = sorted(
            r["compile_ms"] for r in result["rows"] if r["backend"] == name and r["compiled"]
        )
        if ms:
            right.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=name)
    right.set_xscale("log")
    right.set_xlabel("compile time (ms)")
    right.set_ylabel("fraction of compiled schemas")
    right.set_title("compile time")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    cfg = result["config"]
    fig.suptitle(f"grammar benchmark: {cfg['schemas']} schemas, {cfg['tests']} tests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
