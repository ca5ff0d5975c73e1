"""Grammar benchmark (MaskBench-style): compile JSON schemas with each backend, walk their tests.

For every schema and backend, a worker process checks and compiles the schema (as a request
pinned to that backend would be), then walks each test instance, serialised as the grammar
writes it (the whitespace mode's separators; every object's keys in the order its schema
declares them, the only order the backends write), token by token through a matcher: before
each token it fills (and times) the bitmask row, then accepts the token; an instance is
accepted when every token and then EOS are accepted. A crash, hang (killed at --timeout) or
out-of-memory of a backend is recorded and the run goes on. The summary puts the backends side
by side in MaskBench's terms, plus "auto" (baton's per-request fallback, derived from the
results of the backends it tries); it writes JSON, a CSV (one row per schema x backend) and a
PNG (CDFs of mask time per token and compile time). A valid instance rejected only because of
baton's closed-object policy counts apart ("policy", see ``grammar_report``). Then, lenient
mode (issue 55: ``strict: false``, ``allow_unenforced``): every schema a backend refused as
unsupported is compiled again with ``allow_unenforced`` and its tests walked; the summary's
"lenient" part says how many then compile and how many invalid instances they accept (the
keywords dropped no longer hold), apart from the strict figures.

    baton bench grammar [--data PATH ...] [--backends xgrammar,outlines,guidance]
        [--tokenizer default] [--limit N] [--timeout 30] [--jobs 1] [--no-lenient]
        [--out bench/results/grammar.json]

Input: JSONSchemaBench's maskbench files ({"description", "schema", "tests": [{"description",
"valid", "data"}]}) or bare schema files (a schema with no tests: only compiled), found by
recursing into directories (``*.json``). Default data: $BATON_DATA_DIR or ../shared/data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from baton.bench import common
from baton.bench.grammars.grammar_report import (
    auto_rows,
    format_report,
    mask_cdf,
    plot,
    record_row,
    summarize,
    write_csv,
)
from baton.bench.grammars.grammar_runner import run_tasks
from baton.bench.grammars.grammar_worker import (
    BackendFactory,
    SchemaCase,
    Task,
    TestInstance,
    Whitespace,
    WorkerConfig,
    guidance_factory,
    outlines_factory,
    xgrammar_factory,
)
from baton.grammar.spec import AUTO_ORDER
from baton.grammar.vocab import VocabSource

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
DEFAULT_OUT = RESULTS / "grammar.json"

BACKENDS: dict[str, BackendFactory] = {
    "xgrammar": xgrammar_factory,
    "outlines": outlines_factory,
    "guidance": guidance_factory,
}
"""Backends ``--backends`` can name: name -> picklable factory (tests add fakes here)."""


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
        lenient: compile the schemas refused as unsupported again with ``allow_unenforced``
            and walk their tests (the summary's "lenient" part).

    Raises:
        ValueError: naming the bad field and what was expected.
    """

    data: tuple[Path, ...]
    backends: tuple[str, ...] = AUTO_ORDER
    tokenizer: str = "default"
    limit: int | None = None
    timeout_s: float = 30.0
    jobs: int = 1
    whitespace: Whitespace = "compact"
    max_memory_gb: float | None = 8.0
    progress: bool = True
    lenient: bool = True

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
        common.require_positive_ints(self, "jobs")
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

    rows, times = _rows(records, "strict")
    names = list(config.backends)
    if all(name in config.backends for name in AUTO_ORDER):
        extra, extra_times = auto_rows(rows, times)
        rows += extra
        times.update(extra_times)
        names.append("auto")
    summary = {name: summarize(rows, times, name) for name in names}
    lenient = None
    if config.lenient:
        t1 = time.perf_counter()
        lenient = _lenient(rows, records, worker_config, config, names)
        lenient["wall_s"] = time.perf_counter() - t1
    cdf = {}
    for name in names:
        parts = [times[(r["schema"], name)] for r in rows if (r["schema"], name) in times]
        cdf[name] = mask_cdf(np.concatenate(parts) if parts else np.empty(0))
    return {
        "config": _config_record(config, cases, model, vocab_size, wall_s),
        "summary": summary,
        "rows": rows,
        "mask_us_cdf": cdf,
        **({} if lenient is None else {"lenient": lenient}),
    }


def _config_record(
    config: GrammarBenchConfig, cases: list[Any], model: str, vocab_size: int, wall_s: float
) -> dict[str, Any]:
    """The result's "config": what ran, on what, and how long it took."""
    return {
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
    }


def _rows(
    records: Iterable[Any], mode: str
) -> tuple[list[dict[str, Any]], dict[tuple[str, str], np.ndarray]]:
    """The result rows of ``records`` and their mask times by (schema, backend)."""
    rows: list[dict[str, Any]] = []
    times: dict[tuple[str, str], np.ndarray] = {}
    for record in records:
        row, row_times = record_row(record, mode)
        rows.append(row)
        times[(row["schema"], row["backend"])] = row_times
    return rows, times


def _lenient(
    rows: list[dict[str, Any]],
    records: list[Any],
    worker_config: WorkerConfig,
    config: GrammarBenchConfig,
    names: list[str],
) -> dict[str, Any]:
    """Lenient mode on the schemas refused as unsupported: each (schema, backend) that was
    compiled again with ``allow_unenforced`` and walked; "auto" on the schemas that no
    backend served strictly and some refused as unsupported, each backend's lenient result
    standing in for its refusal. Returns {"summary": per name, "rows": lenient rows}."""
    refused = [r for r in records if r.status == "compile_error" and r.error_kind == "unsupported"]
    lenient_config = dataclasses.replace(worker_config, allow_unenforced=True)
    done = run_tasks(
        [r.task for r in refused], lenient_config, config.timeout_s, config.jobs, config.progress
    )
    lenient_rows, times = _rows(done, "lenient")
    if "auto" in names:
        again = {r["schema"] for r in lenient_rows}
        served = {r["schema"] for r in rows if r["backend"] == "auto" and r["compiled"]}
        mine = {(r["schema"], r["backend"]): r for r in lenient_rows}
        merged = [
            mine.get((r["schema"], r["backend"]), r)
            for r in rows
            if r["backend"] != "auto" and r["schema"] in again - served
        ]
        extra, extra_times = auto_rows(merged, times)
        lenient_rows += extra
        times.update(extra_times)
    summary = {name: summarize(lenient_rows, times, name) for name in names}
    return {"summary": summary, "rows": lenient_rows}


def write_results(result: dict[str, Any], out: Path) -> None:
    """Writes ``out`` (JSON, with the run's provenance), the CSV (strict rows, then lenient
    ones: column "mode") and the PNG beside it."""
    common.write_results(result, out, plot)
    lenient_rows = result.get("lenient", {}).get("rows", [])
    write_csv([*result["rows"], *lenient_rows], out.with_suffix(".csv"))


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
        default=AUTO_ORDER,
        help=f"comma-separated, of {', '.join(BACKENDS)}; auto = {'+'.join(AUTO_ORDER)} "
        f"(default: {','.join(AUTO_ORDER)}; auto is reported when all of those run)",
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
        "--no-lenient",
        action="store_true",
        help="skip lenient mode (the schemas refused as unsupported, again with allow_unenforced)",
    )
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
            lenient=not a.no_lenient,
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
