"""bench/common.py: every result records the commit, date and machine it was measured on."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from baton.bench import common


def test_run_info_names_the_checked_out_commit() -> None:
    here = Path(common.__file__).resolve().parent
    head = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    info = common.run_info(dtype="bfloat16")
    assert info["commit"].split("+")[0] == head
    assert info["dtype"] == "bfloat16"
    assert info["torch_threads"] >= 1 and info["cpu_cores"] >= 1
    assert info["date"].endswith("+00:00")


def test_write_results_adds_the_run_and_keeps_given_keys(tmp_path: Path) -> None:
    plotted: list[Path] = []
    out = tmp_path / "r" / "x.json"
    common.write_results(
        {"rows": [1], "run": {"dtype": "float32"}}, out, lambda r, p: plotted.append(p)
    )
    saved = json.loads(out.read_text())
    assert saved["rows"] == [1]
    assert saved["run"]["dtype"] == "float32" and "commit" in saved["run"]
    assert plotted == [out.with_suffix(".png")]


def test_common_args() -> None:
    p = argparse.ArgumentParser()
    common.add_common_args(p, "demo", dtype="bfloat16")
    args = p.parse_args([])
    assert args.model is None and args.dtype == "bfloat16"
    assert args.out == common.RESULTS_DIR / "demo.json"


def test_config_from_args_maps_fields_and_turns_validation_into_a_usage_error() -> None:
    import dataclasses

    import pytest

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        batches: tuple[int, ...] = (1,)
        repeats: int = 1

        def __post_init__(self) -> None:
            if self.repeats < 1:
                raise ValueError("repeats must be >= 1")

    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--unrelated", default="x")
    cfg = common.config_from_args(p, p.parse_args(["--batches", "2", "4"]), Cfg)
    assert cfg == Cfg(batches=(2, 4), repeats=1)
    with pytest.raises(SystemExit) as exc:
        common.config_from_args(p, p.parse_args(["--repeats", "0"]), Cfg)
    assert exc.value.code == 2


def test_git_commit_is_dirty_for_code_changes_only(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for name in ("engine.py", "README.md", "bench/results/x.json"):
        (tmp_path / name).write_text("0\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git("rev-parse", "HEAD")
    assert common.git_commit(tmp_path) == head
    # What benchmarks write leaves the measured code clean.
    (tmp_path / "README.md").write_text("1\n")
    (tmp_path / "bench" / "results" / "x.json").write_text("1\n")
    assert common.git_commit(tmp_path) == head
    (tmp_path / "engine.py").write_text("1\n")
    assert common.git_commit(tmp_path) == f"{head}+dirty"
