"""The two distributions ship every package, each in one of them: baton (pyproject.toml: the
engine, grammar, sampler, kernels) and baton-bench (bench/pyproject.toml: the benchmarks). A
folder of Python modules left out of a ``packages`` list imports from a checkout (editable
install) and is missing from a wheel; the benchmarks in baton's wheel would make an install for
serving carry them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# Each distribution's project folder (where its pyproject.toml is).
DISTRIBUTIONS = {"baton": ROOT, "baton-bench": ROOT / "bench"}
# Where a package of the main distribution lives: baton-bench's folder is inside its tree.
PRODUCT_FOLDERS = ("engine", "grammar", "sampler", "kernels")


def _pyproject(project: Path) -> dict:
    with open(project / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _packages_on_disk(project: Path, package_dir: dict[str, str]) -> set[str]:
    found = set()
    for name, folder in package_dir.items():
        for init in (project / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(project / folder)
            found.add(".".join([name, *rel.parts]))
    return found


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_every_package_folder_is_listed(dist: str) -> None:
    project = DISTRIBUTIONS[dist]
    cfg = _pyproject(project)["tool"]["setuptools"]
    on_disk = _packages_on_disk(project, cfg["package-dir"])
    listed = set(cfg["packages"])
    assert on_disk - listed == set(), "folders with __init__.py missing from [tool.setuptools]"
    assert listed - on_disk == set(), "listed packages with no folder"


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_no_module_folder_lacks_an_init(dist: str) -> None:
    # A folder of modules without __init__.py would be a namespace package, which the explicit
    # packages list never ships.
    project = DISTRIBUTIONS[dist]
    for folder in _pyproject(project)["tool"]["setuptools"]["package-dir"].values():
        for py in (project / folder).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            assert (py.parent / "__init__.py").exists(), f"{py.parent} has modules, no __init__"


def test_the_benchmarks_are_their_own_distribution() -> None:
    from baton.bench.cli import register
    from baton.engine.cli.main import PLUGIN_GROUP

    main = _pyproject(ROOT)
    bench = _pyproject(ROOT / "bench")
    main_packages = main["tool"]["setuptools"]["packages"]
    assert not [p for p in main_packages if p.split(".")[:2] == ["baton", "bench"]]
    assert set(main["tool"]["setuptools"]["package-dir"].values()) == set(PRODUCT_FOLDERS)
    assert all(p.startswith("baton.bench") for p in bench["tool"]["setuptools"]["packages"])
    # The benchmarks' dependencies are baton-bench's, never baton's.
    assert "matplotlib" not in str(main["project"]) and "outlines>" not in str(main["project"])
    assert "baton" in bench["project"]["dependencies"]
    # `baton bench` comes from baton-bench's entry point, the group the engine's CLI reads.
    plugins = bench["project"]["entry-points"][PLUGIN_GROUP]
    assert plugins == {"bench": "baton.bench.cli:register"} and callable(register)


def _wheel(tmp_path: Path, project: str) -> list[str]:
    """The file names in the wheel of ``project`` (a folder of the copy), built from a copy of
    the checkout (bench/ included) so that the build writes nothing into it."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    if not src.exists():
        skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "results", "*.png")
        for folder in (*PRODUCT_FOLDERS, "bench"):
            shutil.copytree(ROOT / folder, src / folder, ignore=skip)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
    out = tmp_path / f"wheel-{project or 'main'}"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "-w", str(out), str(src / project)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.mark.slow
def test_the_wheels_split_the_product_from_the_benchmarks(tmp_path: Path) -> None:
    names = _wheel(tmp_path, "")
    assert {n.split("/")[1] for n in names if n.startswith("baton/")} == set(PRODUCT_FOLDERS)
    assert "baton/engine/cli/main.py" in names
    bench = _wheel(tmp_path, "bench")
    assert {n.split("/")[1] for n in bench if n.startswith("baton/")} == {"bench"}
    assert {"baton/bench/cli.py", "baton/bench/gpu/gpu_check.sh"} <= set(bench)
    # Every benchmark module ships, those in the family folders too.
    on_disk = {
        "baton/bench/" + p.relative_to(ROOT / "bench").as_posix()
        for p in (ROOT / "bench").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk <= set(bench)
    (entry_points,) = [n for n in bench if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points.startswith("baton_bench-")
