"""Where a test file lives: ``tests/`` mirrors the package, so a module's tests are found by its
path (the tests of ``engine/core/scheduler.py`` in ``tests/engine/core/``).

The rule, in order: the table ``PLACES`` (each file placed by what it imports and tests, not by
its name), then a file name's prefix (``PREFIXES``: ``test_kernels_*`` -> ``tests/kernels/``).
A test of the repository as a whole (docs, import layering, packaging, the suite's own helpers)
lives in ``tests/repo/``. A room is a package folder of the repository (``engine/core``,
``grammar``, ...; any folder with ``__init__.py`` under a top-level package) or ``repo``.

Test modules are imported by file name (pytest's default import mode; the test folders have no
``__init__.py``), so a file name is used once in the whole of ``tests/``.

    python tests/layout.py              # what --apply would move, and the files with no room
    python tests/layout.py --apply      # git mv every tests/test_*.py at the top into its room
    python tests/layout.py --fix-refs   # rewrite stale tests/.../test_*.py paths in the repo

Standard library and git only. Exit status 1 when a top-level file has no room (add it to
``PLACES``; the import-based guess printed beside it is only a hint).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
REPO_ROOM = "repo"

_ENGINE_ROOMS = ("core", "worker", "executor", "loader", "models", "processing", "entrypoints")
_ENGINE_ROOMS += ("server", "cli")

# file -> room, decided by reading each file's imports of baton.* and what it asserts.
PLACES: dict[str, str] = {
    # engine/'s shared modules (config, tokenizer, sync check, gc heap)
    "test_config_dtype.py": "engine",
    "test_step_collector.py": "engine",
    "test_sync_check.py": "engine",
    "test_tokenizer.py": "engine",
    "test_tokenizer_sentencepiece.py": "engine",
    # engine/core: scheduler, KV blocks, fills, drafts, stats
    "test_async_scheduler.py": "engine/core",
    "test_bitmask_fill.py": "engine/core",
    "test_draft_policy.py": "engine/core",
    "test_engine_stats.py": "engine/core",
    "test_fill_thread.py": "engine/core",
    "test_kv_cache_manager.py": "engine/core",
    "test_kv_cache_groups.py": "engine/core",
    "test_kv_cache_random.py": "engine/core",
    "test_scheduler.py": "engine/core",
    "test_spec_decode.py": "engine/core",
    # engine/executor: the simulator, the worker process's start
    "test_sim.py": "engine/executor",
    "test_sim_runner.py": "engine/executor",
    "test_worker_start.py": "engine/executor",
    "test_start_workers.py": "engine/executor",
    # engine/worker: the runner and what it owns
    "test_cpu_threads.py": "engine/worker",
    "test_cuda_graphs.py": "engine/worker",
    "test_host_times.py": "engine/worker",
    "test_huge_pages.py": "engine/worker",
    "test_model_runner_device.py": "engine/worker",
    "test_pinned_staging.py": "engine/worker",
    "test_prompt_logprobs.py": "engine/worker",
    "test_tensor_parallel.py": "engine/worker",
    "test_worker_messages.py": "engine/worker",
    # engine/models: the decoders, their numerics and quantised linears
    "test_architectures.py": "engine/models",
    "test_batch_invariance.py": "engine/models",
    "test_cpu_decode.py": "engine/models",
    "test_gemma.py": "engine/models",
    "test_gguf_int8_activations.py": "engine/models",
    "test_gguf_quantized.py": "engine/models",
    "test_gpt_oss.py": "engine/models",
    "test_kv_cache_memory.py": "engine/models",
    "test_model.py": "engine/models",
    "test_packed_weights.py": "engine/models",
    # engine/loader
    "test_gguf_reader.py": "engine/loader",
    "test_loader.py": "engine/loader",
    "test_tp_loader.py": "engine/loader",
    # engine/processing: LLMEngine, detokenizer, outputs
    "test_async_engine.py": "engine/processing",
    "test_detokenizer.py": "engine/processing",
    "test_faults.py": "engine/processing",
    "test_fuzz_engine.py": "engine/processing",
    "test_output_processor.py": "engine/processing",
    # engine/entrypoints: LLM, AsyncLLM, data parallel
    "test_async_llm.py": "engine/entrypoints",
    "test_data_parallel_ray.py": "engine/entrypoints",
    "test_dp_router.py": "engine/entrypoints",
    "test_engine.py": "engine/entrypoints",
    "test_structured.py": "engine/entrypoints",
    # engine/server
    "test_fuzz_http.py": "engine/server",
    "test_server.py": "engine/server",
    "test_harmony.py": "engine/server",
    "test_soak.py": "engine/server",
    "test_tool_call_formats.py": "engine/server",
    # engine/cli
    "test_cli.py": "engine/cli",
    # grammar: backends, schema, compile service, reasoning matcher
    "test_compile_service.py": "grammar",
    "test_mask_accept_agree.py": "grammar",
    "test_reasoning.py": "grammar",
    # sampler
    "test_sampler.py": "sampler",
    # bench
    "test_gpu_check.py": "bench",
    "test_readme_results.py": "bench",
    # the repository as a whole
    "test_docs.py": REPO_ROOM,
    "test_layering.py": REPO_ROOM,
    "test_layout.py": REPO_ROOM,
    "test_memory_guard.py": REPO_ROOM,
    "test_packaging.py": REPO_ROOM,
}

# A file that is not in the table goes by the first prefix its name starts with
# (``test_server.py`` counts as starting with ``test_server_``).
PREFIXES: tuple[tuple[str, str], ...] = (
    ("test_kernels_", "kernels"),
    ("test_grammar_", "grammar"),
    ("test_sampler_", "sampler"),
    ("test_bench_", "bench"),
    ("test_repo_", REPO_ROOM),
    *((f"test_{room}_", f"engine/{room}") for room in _ENGINE_ROOMS),
    ("test_model_", "engine/models"),
    ("test_models_", "engine/models"),
)

# A path to a test file as the repository's text names it: tests/test_x.py, tests/a/b/test_x.py.
_TEST_PATH = re.compile(r"\btests/(?:[\w.]+/)*(test_\w+\.py)\b")
# The text files whose test paths --fix-refs rewrites and test_layout.py checks.
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".cfg", ".ini", ".txt", ".yml", ".yaml"}
_TEXT_NAMES = {"Makefile", "run"}
# A path found from a test file's own place: Path(__file__).resolve().parents[1] and the like.
_FROM_OWN_FILE = re.compile(r"Path\(__file__\)\S*\.parent|os\.path\.dirname\(__file__\)")


def rooms(root: Path = ROOT) -> set[str]:
    """The rooms a test file may live in: every package folder (a folder with ``__init__.py``
    under a top-level folder with one, ``tests/`` aside), as a relative path, and ``repo``."""
    found = {REPO_ROOM}
    for top in sorted(root.iterdir()):
        if top.name.startswith(".") or top.name == "tests" or not (top / "__init__.py").is_file():
            continue
        for init in top.rglob("__init__.py"):
            found.add(init.parent.relative_to(root).as_posix())
    return found


def room_for(name: str) -> str | None:
    """The room of a test file by its name: the table, else a prefix; None when neither."""
    if name in PLACES:
        return PLACES[name]
    return next(
        (
            room
            for prefix, room in PREFIXES
            if name.startswith(prefix) or name == f"{prefix[:-1]}.py"
        ),
        None,
    )


def guess_room(path: Path) -> str | None:
    """A hint for a file with no room: the engine room (or top-level package) it imports most
    often (``from baton.engine.core...`` counts for ``engine/core``); None when it imports none
    or two tie."""
    counts: Counter[str] = Counter()
    for match in re.finditer(r"^\s*(?:from|import) baton\.([\w.]+)", path.read_text(), re.M):
        parts = match.group(1).split(".")
        engine_room = parts[0] == "engine" and len(parts) > 1 and parts[1] in _ENGINE_ROOMS
        counts["/".join(parts[:2]) if engine_room else parts[0]] += 1
    ranked = counts.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


def test_files(tests: Path = TESTS) -> list[Path]:
    """Every test module under ``tests``."""
    return sorted(tests.rglob("test_*.py"))


def misplaced(tests: Path = TESTS, root: Path = ROOT) -> list[str]:
    """What breaks the layout, one line each: a test file at the top of ``tests/`` or in a
    folder that is no room, a file name used twice, a conftest.py below the top, an
    __init__.py."""
    allowed = rooms(root)
    problems = []
    for path in test_files(tests):
        folder = path.parent.relative_to(tests).as_posix()
        if folder == ".":
            where = room_for(path.name) or guess_room(path) or "?"
            problems.append(f"tests/{path.name}: at the top of tests/ (its room: tests/{where}/)")
        elif folder not in allowed:
            problems.append(f"tests/{folder}/{path.name}: {folder} is no package folder")
    names = Counter(path.name for path in test_files(tests))
    problems += [f"{name}: used {n} times in tests/" for name, n in names.items() if n > 1]
    # pytest imports a conftest.py outside a package as module "conftest" (the last one loaded
    # replaces the others in sys.modules, so ``from conftest import`` would find it), and an
    # __init__.py would make the test modules' names depend on their folders.
    for name in ("conftest.py", "__init__.py"):
        for path in sorted(tests.rglob(name)):
            if path.parent != tests or name == "__init__.py":
                rel = path.relative_to(tests).as_posix()
                problems.append(f"tests/{rel}: tests/ has one conftest.py and no __init__.py")
    return problems


def plan(tests: Path = TESTS) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """The moves ``--apply`` makes (top-level file -> its room) and the top-level files that
    have none."""
    moves, homeless = [], []
    for path in sorted(tests.glob("test_*.py")):
        room = room_for(path.name)
        if room is None:
            homeless.append(path)
        else:
            moves.append((path, tests / room / path.name))
    return moves, homeless


def text_files(root: Path = ROOT) -> list[Path]:
    """The repository's text files that may name a test file (no hidden folders, no venv)."""
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") and part != ".ci" for part in rel.parts[:-1]):
            continue
        if "__pycache__" in rel.parts or not path.is_file():
            continue
        if path.suffix in _TEXT_SUFFIXES or path.name in _TEXT_NAMES:
            found.append(path)
    return sorted(found)


def stale_references(root: Path = ROOT, tests: Path = TESTS) -> list[tuple[Path, str, str]]:
    """``(file, path as written, the file's real path)`` for each ``tests/.../test_x.py`` in the
    repository's text that names an existing test file by a path it no longer has. Made-up
    names (no such test file anywhere) are left alone."""
    where = {p.name: p.relative_to(root).as_posix() for p in test_files(tests)}
    stale = []
    for path in text_files(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in _TEST_PATH.finditer(text):
            real = where.get(match.group(1))
            if real is not None and match.group(0) != real:
                stale.append((path, match.group(0), real))
    return stale


def _git(*args: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), *args], check=True)


def _apply(moves: list[tuple[Path, Path]]) -> None:
    for src, dst in moves:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
        if _FROM_OWN_FILE.search(dst.read_text()):
            # A path built from the file's own place counts folders up from it, which changed.
            print(f"check: {dst.relative_to(ROOT)} builds a path from __file__ (conftest.ROOT?)")


def _fix_refs() -> int:
    stale = stale_references()
    renames = {old: new for _, old, new in stale}
    for path in sorted({p for p, _, _ in stale}):
        text = path.read_text()
        path.write_text(_TEST_PATH.sub(lambda m: renames.get(m.group(0), m.group(0)), text))
    for path, old, new in stale:
        print(f"{path.relative_to(ROOT)}: {old} -> {new}")
    return len(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apply", action="store_true", help="git mv the top-level test files")
    parser.add_argument(
        "--fix-refs", action="store_true", help="rewrite stale test paths in the repository"
    )
    args = parser.parse_args(argv)
    moves, homeless = plan()
    allowed = rooms()
    for src, dst in moves:
        room = dst.parent.relative_to(TESTS).as_posix()
        if room not in allowed:
            print(f"{src.name}: its room {room} is no package folder; fix PLACES or PREFIXES")
            return 1
        print(f"{src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    if args.apply:
        _apply(moves)
    if args.fix_refs:
        print(f"{_fix_refs()} references rewritten")
    for path in homeless:
        hint = guess_room(path)
        guess = f" (its imports suggest {hint})" if hint else ""
        print(f"{path.relative_to(ROOT)}: no room; add it to PLACES in tests/layout.py{guess}")
    return 1 if homeless else 0


if __name__ == "__main__":
    sys.exit(main())
