"""What every benchmark shares: the options that pick a model and where results go, the run's
provenance (git commit, date, machine, threads), and writing its JSON and plot.

A benchmark file keeps only its workload and its table: ``add_common_args`` for its parser,
``write_results`` at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from baton.bench.plotting import save_results
from baton.bench.tables import num_cell

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPE_CHOICES = ("float32", "bfloat16")


def add_common_args(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    model: bool = True,
    dtype: str | None = "float32",
) -> None:
    """Adds ``--out`` (default ``bench/results/NAME.json``) and, unless turned off,
    ``--model`` (None: the default model) and ``--dtype`` (default ``dtype``)."""
    if model:
        parser.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    if dtype is not None:
        parser.add_argument("--dtype", default=dtype, choices=DTYPE_CHOICES)
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / f"{name}.json",
        help=f"default: results/{name}.json",
    )


_REPO_ROOT = Path(__file__).resolve().parent.parent
# What a benchmark writes, not the code it measures: changed files there leave a run "clean", so
# several benchmarks run one after another on one commit all name that commit.
_NOT_CODE = ("bench/results", "README.md", "docs/results.md")


def _git(*args: str, env: dict[str, str] | None = None, root: Path = _REPO_ROOT) -> str:
    """``git -C <root> args...``'s output, stripped (``root``: this repository's).

    Raises:
        OSError, subprocess.SubprocessError: git is missing, fails or hangs.
    """
    return subprocess.run(
        ["git", "-C", str(root), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout.strip()


def run_order(items: Sequence[T], repeat: int) -> list[T]:
    """The order of the ``repeat``-th run (0-based): as given, reversed every other run, so
    nothing measured always runs first (warm caches, a machine still busy, thermal drift)."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


def git_commit(root: Path = _REPO_ROOT) -> str:
    """The commit of the code being measured, with ``+dirty`` when tracked files other than
    results, the README and docs/results.md (``_NOT_CODE``) have uncommitted changes, or
    ``unknown`` outside a git checkout."""
    excluded = [f":(exclude){p}" for p in _NOT_CODE]
    try:
        head = _git("rev-parse", "HEAD", root=root)
        dirty = _git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded, root=root
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def git_tree() -> str:
    """The git tree hash of the checkout's files as they are (tracked and untracked, not
    ignored), or ``unknown``. It names the code measured even where the git metadata is older
    than the files (the device tool's copy carries the session's first commit): the commit
    whose tree it is (``git log --format='%H %T'``) is the code that ran."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            _git("add", "-A", ".", env=env)
            return _git("write-tree", env=env)
        except (OSError, subprocess.SubprocessError):
            return "unknown"


# The CPU features a result can depend on: the vector and matrix units that torch, oneDNN and
# baton's native kernels pick their code by (x86: AVX2/FMA, AVX-512 and its VNNI/BF16/FP16
# extensions, AMX; Arm: NEON dot products, SVE, BF16 and int8 matrix multiply).
X86_CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)
ARM_CPU_FLAGS = ("asimd", "asimddp", "sve", "sve2", "bf16", "i8mm")


def _cpuinfo_field(text: str, *names: str) -> str | None:
    """The value of the first line of /proc/cpuinfo ``text`` whose key is one of ``names``."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in names:
            return value.strip()
    return None


ISA_LIMIT_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_features(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU this runs on: ``cpu_model`` (its model name), ``cpu_flags`` (each feature of
    ``X86_CPU_FLAGS`` or ``ARM_CPU_FLAGS``, by the machine's architecture, mapped to whether the
    CPU reports it) and ``torch_cpu_capability`` (the vector ISA torch's kernels dispatch to).

    ``isa_limits``: those of ``ISA_LIMIT_VARIABLES`` set in the environment, which hold torch
    and oneDNN below what the CPU has.

    ``cpuinfo``: the text of /proc/cpuinfo (read when None); model "unknown" and no flags where
    it cannot be read."""
    import torch

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = _cpuinfo_field(cpuinfo, "model name", "Model") or platform.processor() or "unknown"
    present = set((_cpuinfo_field(cpuinfo, "flags", "Features") or "").split())
    arm = platform.machine().lower() in ("aarch64", "arm64")
    wanted = ARM_CPU_FLAGS if arm else X86_CPU_FLAGS
    return {
        "cpu_model": model,
        "cpu_flags": {flag: flag in present for flag in wanted} if present else {},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # Set to run as on a smaller CPU (``make test-avx2-only``'s variables): then the flags
        # above are the machine's, not what the kernels used.
        "isa_limits": {k: os.environ[k] for k in ISA_LIMIT_VARIABLES if os.environ.get(k)},
    }


def cpu_description(features: dict[str, Any] | None = None) -> str:
    """The CPU's model name and its bfloat16 matrix units (AMX, AVX512-BF16), as one line, with
    the ISA limits set in the environment if any; ``features`` from ``cpu_features`` (read when
    None)."""
    features = features or cpu_features()
    flags = features["cpu_flags"]
    units = [
        name
        for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"))
        if flags.get(flag)
    ]
    limits = features.get("isa_limits") or {}
    held = f", limited to {'/'.join(sorted(set(limits.values())))}" if limits else ""
    return f"{features['cpu_model']} ({', '.join(units) or 'no bf16 units'}{held})"


def run_info(**extra: Any) -> dict[str, Any]:
    """Where and when a run happened: commit, UTC date, machine, CPU (``cpu``: model and bf16
    units in one line; ``cpu_model``, ``cpu_flags`` and ``torch_cpu_capability`` from
    ``cpu_features``), cores, torch threads; ``extra`` (e.g. the dtype) is merged in."""
    import torch

    features = cpu_features()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "commit": git_commit(),
        "tree": git_tree(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_cores": cores,
        "cpu": cpu_description(features),
        **features,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    info.update(extra)
    return info


def write_results(
    result: dict[str, Any],
    out: Path,
    plot: Callable[[dict, Path], None] | None,
    **run_extra: Any,
) -> None:
    """Adds the run's provenance to ``result["run"]`` (keeping keys already there), then
    writes ``result`` as JSON to ``out`` and its plot (if any) beside it (same name, .png)."""
    result["run"] = {**run_info(**run_extra), **result.get("run", {})}
    save_results(result, out, plot or (lambda result, path: None))


def config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cls: type[T], **overrides: Any
) -> T:
    """The benchmark's frozen config dataclass ``cls`` from the parsed ``args`` whose names are
    its fields (lists become tuples), with ``overrides`` on top.

    A ``ValueError`` from the config's own validation becomes the parser's usage error (one
    line, exit status 2), like any other bad option.
    """
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this line only satisfies type checkers


def csv_of(kind: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """An argparse ``type`` for a comma-separated list of ``kind`` (``csv_of(int)`` reads
    ``"1,8,32"`` as ``(1, 8, 32)``); a bad item is argparse's usage error naming the text."""

    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            name = getattr(kind, "__name__", "value")
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {name}s, got {text!r}"
            ) from None

    parse.__name__ = f"csv_of_{getattr(kind, '__name__', 'value')}"
    return parse


# A table cell: ``value`` in ``spec``'s format, "-" for None (the tables' own, bench/tables.py).
fmt = num_cell


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, None when either is missing or ``den`` is 0."""
    return num / den if num is not None and den else None


def judge_goal(
    name: str, target: str, values: dict[str, float | None], worst: str, threshold: float
) -> dict[str, Any]:
    """A goal judged on its worst measured value: ``worst`` "min" (the smallest value must be
    >= ``threshold``) or "max" (the largest must be <= it). ``met`` is None when nothing was
    measured. Returns the goal as a result entry (name, target, value, met, values)."""
    measured = [v for v in values.values() if v is not None]
    if not measured:
        return {"goal": name, "target": target, "value": None, "met": None, "values": values}
    value = min(measured) if worst == "min" else max(measured)
    met = value >= threshold if worst == "min" else value <= threshold
    return {"goal": name, "target": target, "value": value, "met": met, "values": values}


def print_goals(goals: list[dict[str, Any]]) -> None:
    """Prints judged goals (``judge_goal``'s entries), one line each with every value."""
    print("\ngoals:")
    for g in goals:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        values = ", ".join(f"{k}: {fmt(v, '.3f')}" for k, v in g["values"].items())
        print(f"  [{verdict}] {g['goal']} {g['target']}: {fmt(g['value'], '.3f')}  ({values})")


def require_positive_ints(config: object, *names: str) -> None:
    """For a config's ``__post_init__``: each named field must be an int >= 1.

    Raises:
        ValueError: naming the first field that is not, and its value.
    """
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
