"""pyproject.toml ships every package: a folder of Python modules left out of its ``packages``
list imports from a checkout (editable install) and is missing from a wheel."""

from __future__ import annotations

import pytest
from conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    found = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_folder_is_listed() -> None:
    cfg = _setuptools()
    on_disk = _packages_on_disk(cfg["package-dir"])
    listed = set(cfg["packages"])
    assert on_disk - listed == set(), "folders with __init__.py missing from [tool.setuptools]"
    assert listed - on_disk == set(), "listed packages with no folder"


def test_no_module_folder_lacks_an_init() -> None:
    # A folder of modules without __init__.py would be a namespace package, which the explicit
    # packages list never ships.
    cfg = _setuptools()
    for folder in cfg["package-dir"].values():
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            assert (py.parent / "__init__.py").exists(), f"{py.parent} has modules, no __init__"
