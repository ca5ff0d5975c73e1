"""Grammar benchmark (MaskBench-style): compile JSON schemas with each backend, walk their tests.

For every schema and backend, a worker process checks and compiles the schema (as a request
pinned to that backend would be), then walks each test instance, serialised as the grammar
expects it, token by token through a matcher: before each token it fills (and times) the
bitmask row, then accepts the token; an instance is accepted when every token and then EOS are
accepted. A crash, hang (killed at --timeout) or out-of-memory of a backend is recorded and the
run goes on. The summary puts the backends side by side in MaskBench's terms, plus "auto"
(baton's per-request fallback, derived from the xgrammar and outlines results); it writes JSON,
a CSV (one row per schema x backend) and a PNG (CDFs of mask time per token and compile time).

    baton bench grammar [--data PATH ...] [--backends xgrammar,outlines] [--tokenizer default]
        [--limit N] [--timeout 30] [--jobs 1] [--out bench/results/grammar.json]

Input: JSONSchemaBench's maskbench files ({"description", "schema", "tests": [{"description",
"valid", "data"}]}) or bare schema files (a schema with no tests: only compiled), found by
recursing into directories (``*.json``). Default data: $BATON_DATA_DIR or ../shared/data.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Literal

import numpy as np

from baton.bench.grammar_worker import (
    BackendFactory,
    SchemaCase,
    Task,
    TestInstance,
    Whitespace,
    WorkerConfig,
    guidance_factory,
    outlines_factory,
    worker_main,
    xgrammar_factory,
)
from baton.bench.plotting import pyplot, save_results
from baton.grammar.compile_service import AUTO_ORDER
from baton.grammar.vocab import VocabSource

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_OUT = RESULTS / "grammar.json"

BACKENDS: dict[str, BackendFactory] = {
    "xgrammar": xgrammar_factory,
    "outlines": outlines_factory,
    "guidance": guidance_factory,
}
"""Backends ``--backends`` can name: name -> picklable factory (tests add fakes here)."""

STARTUP_TIMEOUT_S = 300.0
"""A worker that has not built its backends by then stops the run."""

Status = Literal["ok", "compile_error", "timeout", "crash", "oom"]
CDF_PERCENTILES = np.linspace(0.0, 100.0, 201)
CSV_COLUMNS = (
    "schema",
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


def default_data_dir() -> Path:
    """$BATON_DATA_DIR, or ``shared/data`` beside the repository."""
    env = os.environ.get("BATON_DATA_DIR")
    return Path(env) if env else REPO.parent / "shared" / "data"


@dataclass(frozen=True)
class GrammarBenchConfig:
    """What to run; validated at construction.

    Attributes:
        data: schema files or directories (recursed for ``*.json``).
        backends: backend names, each a key of the factories used (``BACKENDS`` by default).
        tokenizer: "default" (the default model's) or a GGUF file / Hugging Face folder.
        limit: first N schema files only (sorted by path), None for all.
        timeout_s: limit on one compile and on the walk of one test instance.
        jobs: worker processes in parallel.
        whitespace: the spec's whitespace mode ("compact" is baton's default).
        max_memory_gb: address-space limit per worker (None: none).
        progress: show a tqdm bar on stderr.

    Raises:
        ValueError: naming the bad field and what was expected.
    """

    data: tuple[Path, ...]
    backends: tuple[str, ...] = ("xgrammar", "outlines")
    tokenizer: str = "default"
    limit: int | None = None
    timeout_s: float = 30.0
    jobs: int = 1
    whitespace: Whitespace = "compact"
    max_memory_gb: float | None = 8.0
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", tuple(Path(p) for p in self.data))
        object.__setattr__(self, "backends", tuple(dict.fromkeys(self.backends)))
        if not self.data:
            raise ValueError("data must name at least one schema file or directory")
        if not self.backends:
            raise ValueError("backends must name at least one backend")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit must be a positive int or None, got {self.limit!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"jobs must be an int >= 1, got {self.jobs!r}")
        if self.whitespace not in ("compact", "any"):
            raise ValueError(f"whitespace must be 'compact' or 'any', got {self.whitespace!r}")
        if self.max_memory_gb is not None and not self.max_memory_gb > 0:
            raise ValueError(f"max_memory_gb must be > 0 or None, got {self.max_memory_gb!r}")


# ------------------------------------------------------------------------------------ input


def parse_schema_file(path: Path, case_id: str) -> SchemaCase:
    """Reads one file: maskbench format when it is an object with "schema" and "tests", else a
    bare schema (an object or a boolean) with no tests.

    Raises:
        ValueError: the file is not JSON, or its content is neither form (naming the file).
    """
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a JSON schema file: {exc}") from None
    if isinstance(content, dict) and "schema" in content and "tests" in content:
        tests = content["tests"]
        if not isinstance(tests, list):
            raise ValueError(f"{path}: 'tests' must be a list, got {type(tests).__name__}")
        instances = []
        for i, test in enumerate(tests):
            if not isinstance(test, dict) or "data" not in test or "valid" not in test:
                raise ValueError(
                    f"{path}: test {i} must be an object with 'valid' and 'data' (and an "
                    "optional 'description')"
                )
            if not isinstance(test["valid"], bool):
                raise ValueError(f"{path}: test {i}: 'valid' must be true or false")
            description = str(test.get("description", f"test {i}"))
            instances.append(TestInstance(description, test["valid"], test["data"]))
        return SchemaCase(case_id, content["schema"], tuple(instances))
    if isinstance(content, (dict, bool)):
        return SchemaCase(case_id, content)
    raise ValueError(
        f"{path}: expected a schema (object or boolean) or a maskbench file, got "
        f"{type(content).__name__}"
    )


def find_schema_files(paths: Iterable[Path]) -> list[tuple[Path, str]]:
    """(file, case id) for each path: a file as it is, a directory's ``*.json`` recursively,
    sorted; the id is the path relative to the directory given (the file name for a file).

    Raises:
        ValueError: a path does not exist.
    """
    found: list[tuple[Path, str]] = []
    for root in paths:
        if root.is_file():
            found.append((root, root.name))
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*.json") if p.is_file())
            found += [(p, p.relative_to(root).as_posix()) for p in files]
        else:
            raise ValueError(f"{root}: no such schema file or directory")
    seen: Counter[str] = Counter(case_id for _, case_id in found)
    return [(p, str(p) if seen[case_id] > 1 else case_id) for p, case_id in found]


def load_cases(paths: Iterable[Path], limit: int | None = None) -> list[SchemaCase]:
    """The schema cases under ``paths`` (first ``limit`` files only).

    Raises:
        ValueError: a path is missing, a file is not a schema, or nothing was found.
    """
    paths = list(paths)
    files = find_schema_files(paths)
    if limit is not None:
        files = files[:limit]
    if not files:
        raise ValueError(f"no *.json schema files in {', '.join(map(str, paths))}")
    return [parse_schema_file(path, case_id) for path, case_id in files]


def load_model_tokenizer(spec: str) -> tuple[VocabSource, int, str]:
    """The tokenizer, model vocabulary size and model path for ``--tokenizer``.

    ``spec`` is "default" (SmolLM2-135M's GGUF), a GGUF file (vocab size from
    ``{arch}.vocab_size``, else the token count) or a Hugging Face folder (``vocab_size`` of its
    config.json, else the tokenizer's size).

    Raises:
        ValueError (``ModelLoadError``): the path cannot be read as a tokenizer.
    """
    from baton.engine.loader import default_model_path, load_tokenizer

    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from baton.engine.loader.gguf import gguf_metadata, load_gguf_tokenizer, read_gguf

        # One read of the metadata for both (reading it is most of the cost).
        meta = gguf_metadata(read_gguf(path), path)
        tokenizer = load_gguf_tokenizer(path, meta)
        size = meta.get(f"{meta.get('general.architecture')}.vocab_size")
        if not isinstance(size, int):
            size = len(meta.get("tokenizer.ggml.tokens") or ()) or tokenizer.vocab_size
        return tokenizer, size, str(path)
    tokenizer = load_tokenizer(path)
    size = tokenizer.vocab_size
    config = path / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("vocab_size")
        size = value if isinstance(value, int) and value > 0 else size
    return tokenizer, size, str(path)


# ------------------------------------------------------------------------------ the workers


@dataclass
class TaskRecord:
    """What came back for one task so far.

    Attributes:
        task: the schema and backend.
        status: None while running, then how it ended.
        error_kind: for a compile error: "invalid", "unsupported", "compile" or "oom".
        error: why it failed (the compile error, time-out or crash), None when ok.
        compile_reported: the worker has reported the compile's outcome (later failures are
            during a test's walk).
        compiled: the schema compiled.
        compile_s: seconds of the backend's check and compile.
        instances: the ``InstanceOutcome``s (as dicts) of the tests walked so far.
    """

    task: Task
    status: Status | None = None
    error_kind: str | None = None
    error: str | None = None
    compile_reported: bool = False
    compiled: bool = False
    compile_s: float | None = None
    instances: list[dict[str, Any]] = field(default_factory=list)


def _death_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = {"SIGKILL": " (out of memory?)", "SIGABRT": " (abort; a failed allocation?)"}
        return f"was killed by {name}{hint.get(name, '')}"
    return f"exited with code {exitcode}"


class _Worker:
    """One worker process and the task it is serving."""

    def __init__(self, ctx: BaseContext, config: WorkerConfig) -> None:
        parent, child = ctx.Pipe()
        self.process = ctx.Process(  # type: ignore[attr-defined]
            target=worker_main, args=(child, config), name="baton-grammar-bench", daemon=True
        )
        self.process.start()
        child.close()  # so that the parent sees EOF when the worker dies
        self.conn: Connection = parent
        self.state: Literal["starting", "idle", "busy", "dead"] = "starting"
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self.record: TaskRecord | None = None

    def start(self, task: Task, timeout_s: float) -> None:
        self.record = TaskRecord(task)
        self.conn.send(task)
        self.state = "busy"
        self.deadline = time.monotonic() + timeout_s

    def receive(self, timeout_s: float) -> TaskRecord | None:
        """Reads one message; returns the record once its task is over.

        Raises:
            RuntimeError: the worker failed while starting.
        """
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            return self._died()
        kind = message[0]
        if self.state == "starting":
            if kind == "fatal":
                self.close()
                raise RuntimeError(
                    f"a benchmark worker could not build its backends:\n{message[1]}"
                )
            self.state = "idle"
            return None
        record = self.record
        assert record is not None
        self.deadline = time.monotonic() + timeout_s
        if kind == "compiled":
            outcome = message[1]
            record.compile_reported = True
            record.compiled = outcome["ok"]
            record.compile_s = outcome["compile_s"]
            record.error_kind = outcome["error_kind"]
            record.error = outcome["error"]
        elif kind == "instance":
            record.instances.append(message[1])
        else:  # "done"
            if record.compiled:
                record.status = "ok"
            else:
                record.status = "oom" if record.error_kind == "oom" else "compile_error"
            self.state = "idle"
            self.record = None
            return record
        return None

    def _phase(self, record: TaskRecord) -> str:
        if not record.compile_reported:
            return "compile"
        tests = record.task.case.tests
        index = len(record.instances)
        description = tests[index].description if index < len(tests) else "?"
        return f"test {index} ({description!r})"

    def _died(self) -> TaskRecord:
        self.process.join(timeout=5)
        reason = _death_reason(self.process.exitcode)
        self.close()
        if self.record is None:
            raise RuntimeError(f"a benchmark worker {reason} while starting")
        record, self.record = self.record, None
        record.status = "crash"
        record.error_kind = None
        record.error = f"the worker {reason} during {self._phase(record)}"
        return record

    def expire(self, timeout_s: float) -> TaskRecord:
        """Kills the worker at its deadline; returns the timed-out record.

        Raises:
            RuntimeError: the worker had not started by its deadline.
        """
        self.close()
        if self.record is None:
            raise RuntimeError(f"a benchmark worker did not start within {STARTUP_TIMEOUT_S} s")
        record, self.record = self.record, None
        record.status = "timeout"
        record.error_kind = None
        record.error = f"{self._phase(record)} took longer than {timeout_s:g} s"
        return record

    def close(self) -> None:
        """Stops the process (politely when idle) and closes the pipe."""
        if self.state == "dead":
            return
        if self.state == "idle" and self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()
        self.state = "dead"


def run_tasks(
    tasks: Sequence[Task],
    config: WorkerConfig,
    timeout_s: float,
    jobs: int = 1,
    progress: bool = True,
) -> list[TaskRecord]:
    """Runs ``tasks`` on ``jobs`` worker processes ("spawn" context), replacing a worker that
    crashed or was killed at its deadline; returns one record per task, in task order.

    Raises:
        RuntimeError: a worker could not start (bad backend factory, or it died while starting).
    """
    from tqdm import tqdm

    ctx = mp.get_context("spawn")
    pending = deque(tasks)
    done: list[TaskRecord] = []
    workers = [_Worker(ctx, config) for _ in range(min(jobs, len(tasks)))]
    bar = tqdm(total=len(tasks), unit="task", file=sys.stderr, disable=not progress)
    try:
        while pending or any(w.state == "busy" for w in workers):
            for i, worker in enumerate(workers):
                if worker.state == "idle" and not worker.process.is_alive():
                    worker.close()
                if worker.state == "dead" and pending:
                    workers[i] = worker = _Worker(ctx, config)
                if worker.state == "idle" and pending:
                    worker.start(pending.popleft(), timeout_s)
            waiting = [w for w in workers if w.state in ("starting", "busy")]
            wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            ready = wait([w.conn for w in waiting], timeout=wait_s)
            for worker in waiting:
                if worker.conn in ready:
                    finished = worker.receive(timeout_s)
                elif time.monotonic() >= worker.deadline:
                    finished = worker.expire(timeout_s)
                else:
                    continue
                if finished is not None:
                    done.append(finished)
                    bar.set_postfix_str(f"{finished.task.backend} {finished.task.case.id}"[:60])
                    bar.update(1)
    finally:
        bar.close()
        for worker in workers:
            worker.close()
    order = {id(task): i for i, task in enumerate(tasks)}
    return sorted(done, key=lambda r: order[id(r.task)])


# ------------------------------------------------------------------------------ the results


def _stats(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """avg, p50, p99 and max (None each when there are no values)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"avg": None, "p50": None, "p99": None, "max": None}
    p50, p99 = np.percentile(arr, [50, 99])
    return {"avg": float(arr.mean()), "p50": float(p50), "p99": float(p99), "max": float(arr.max())}


def record_row(record: TaskRecord) -> tuple[dict[str, Any], np.ndarray]:
    """The result row of one task (CSV-ready scalars, plus a "failures" list) and its mask
    times per token (µs)."""
    times = np.asarray([t for inst in record.instances for t in inst["mask_us"]], dtype=np.float64)
    wrong = [i for i in record.instances if i["accepted"] != i["valid"] or i["error"]]
    valid_run = sum(1 for i in record.instances if i["valid"])
    valid_rejected = sum(1 for i in record.instances if i["valid"] and not i["accepted"])
    invalid_accepted = sum(1 for i in record.instances if not i["valid"] and i["accepted"])
    stats = _stats(times)
    failures = [
        f"{'valid' if i['valid'] else 'invalid'} {'accepted' if i['accepted'] else 'rejected'}: "
        f"{i['description']}" + (f" [{i['error']}]" if i["error"] else "")
        for i in wrong[:_MAX_FAILURES_LISTED]
    ]
    row = {
        "schema": record.task.case.id,
        "backend": record.task.backend,
        "served_by": record.task.backend,
        "status": record.status,
        "error_kind": record.error_kind,
        "error": record.error,
        "compiled": record.compiled,
        "compile_ms": None if record.compile_s is None else record.compile_s * 1e3,
        "tests": len(record.task.case.tests),
        "tests_run": len(record.instances),
        "valid_tests": valid_run,
        "invalid_tests": len(record.instances) - valid_run,
        "valid_rejected": valid_rejected,
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
    timeouts_crashes, tests_run, valid_tests, invalid_tests, valid_rejected, invalid_accepted,
    instance_errors, tokens, mask_mismatches, compile_ms and mask_us ({avg, p50, p99, max}).
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


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("xgrammar", "outlines-core", "baton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def run_benchmark(
    config: GrammarBenchConfig,
    *,
    tokenizer: VocabSource | None = None,
    vocab_size: int | None = None,
    factories: Mapping[str, BackendFactory] | None = None,
) -> dict[str, Any]:
    """Runs the benchmark and returns the result (config, summary per backend and "auto",
    rows, mask-time CDFs); writes nothing.

    Args:
        config: what to run.
        tokenizer, vocab_size: use these instead of loading ``config.tokenizer`` (both or
            neither).
        factories: backend name -> factory (default ``BACKENDS``).

    Raises:
        ValueError: bad data, an unknown backend name, or an unreadable tokenizer.
        RuntimeError: a worker could not start.
    """
    factories = dict(BACKENDS if factories is None else factories)
    unknown = [b for b in config.backends if b not in factories]
    if unknown:
        raise ValueError(
            f"unknown backend(s) {', '.join(unknown)}; expected some of {', '.join(factories)}"
        )
    if (tokenizer is None) != (vocab_size is None):
        raise ValueError("give both tokenizer and vocab_size, or neither")
    cases = load_cases(config.data, config.limit)
    model = "given"
    if tokenizer is None:
        tokenizer, vocab_size, model = load_model_tokenizer(config.tokenizer)
    assert vocab_size is not None
    max_bytes = None if config.max_memory_gb is None else int(config.max_memory_gb * 2**30)
    worker_config = WorkerConfig(
        tokenizer,
        vocab_size,
        {name: factories[name] for name in config.backends},
        config.whitespace,
        max_bytes,
    )
    tasks = [Task(case, backend) for case in cases for backend in config.backends]
    t0 = time.perf_counter()
    records = run_tasks(tasks, worker_config, config.timeout_s, config.jobs, config.progress)
    wall_s = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    times: dict[tuple[str, str], np.ndarray] = {}
    for record in records:
        row, row_times = record_row(record)
        rows.append(row)
        times[(row["schema"], row["backend"])] = row_times
    names = list(config.backends)
    if all(name in config.backends for name in AUTO_ORDER):
        extra, extra_times = auto_rows(rows, times)
        rows += extra
        times.update(extra_times)
        names.append("auto")
    summary = {name: summarize(rows, times, name) for name in names}
    cdf = {}
    for name in names:
        parts = [times[(r["schema"], name)] for r in rows if (r["schema"], name) in times]
        cdf[name] = mask_cdf(np.concatenate(parts) if parts else np.empty(0))
    return {
        "config": {
            "data": [str(p) for p in config.data],
            "schemas": len(cases),
            "tests": sum(len(c.tests) for c in cases),
            "backends": list(config.backends),
            "tokenizer": model,
            "vocab_size": vocab_size,
            "whitespace": config.whitespace,
            "limit": config.limit,
            "timeout_s": config.timeout_s,
            "jobs": config.jobs,
            "max_memory_gb": config.max_memory_gb,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "versions": _versions(),
            "wall_s": wall_s,
        },
        "summary": summary,
        "rows": rows,
        "mask_us_cdf": cdf,
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
    return "\n".join(lines)


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


def write_results(result: dict[str, Any], out: Path) -> None:
    """Writes ``out`` (JSON), the CSV and the PNG beside it (same name)."""
    save_results(result, out, plot)
    write_csv(result["rows"], out.with_suffix(".csv"))


# ------------------------------------------------------------------------------------- CLI


def _backend_list(text: str) -> tuple[str, ...]:
    names: list[str] = []
    for name in (x.strip() for x in text.split(",")):
        if not name:
            continue
        # "auto" is derived from its backends' results: run those.
        names += list(AUTO_ORDER) if name == "auto" else [name]
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of backends, got {text!r}"
        )
    return tuple(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """The ``baton bench grammar`` argument parser."""
    p = argparse.ArgumentParser(prog="baton bench grammar", description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        nargs="+",
        type=Path,
        default=None,
        help="schema files or directories (default: $BATON_DATA_DIR or ../shared/data)",
    )
    p.add_argument(
        "--backends",
        type=_backend_list,
        default=("xgrammar", "outlines"),
        help=f"comma-separated, of {', '.join(BACKENDS)}; auto = {'+'.join(AUTO_ORDER)} "
        "(default: xgrammar,outlines; auto is reported when both run)",
    )
    p.add_argument(
        "--tokenizer",
        default="default",
        help="'default' (SmolLM2-135M) or a GGUF file / Hugging Face folder",
    )
    p.add_argument("--limit", type=int, default=None, help="first N schema files only")
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds allowed for one compile and for one test's walk (default: 30)",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default: 1)")
    p.add_argument(
        "--whitespace",
        choices=("compact", "any"),
        default="compact",
        help="the specs' whitespace mode; instances are serialised to match (default: compact)",
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="address-space limit per worker, 0 for none (default: 8)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON path; the CSV and PNG go beside it"
    )
    return p


def config_from_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> GrammarBenchConfig:
    """The config that ``build_parser``'s arguments ``a`` name; a bad one exits through
    ``p.error`` (SystemExit 2) naming it."""
    unknown = [b for b in a.backends if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {', '.join(unknown)}; expected some of {', '.join(BACKENDS)}")
    try:
        return GrammarBenchConfig(
            data=tuple(a.data) if a.data else (default_data_dir(),),
            backends=a.backends,
            tokenizer=a.tokenizer,
            limit=a.limit,
            timeout_s=a.timeout,
            jobs=a.jobs,
            whitespace=a.whitespace,
            max_memory_gb=a.max_memory_gb or None,
            progress=not a.no_progress,
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """Runs ``baton bench grammar``: prints the summary and writes JSON, CSV and PNG.

    Exits through argparse (SystemExit 2) on a bad argument; raises ValueError for unreadable
    data or tokenizer (the ``baton`` CLI prints it as one line).
    """
    p = build_parser()
    a = p.parse_args(argv)
    config = config_from_args(p, a)
    result = run_benchmark(config)
    print(format_report(result))
    write_results(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
