"""The C++ extension loader's build turns (kernels/cpp_build.py): a build killed half way must
not leave every later load waiting on torch's lock file."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch.utils import cpp_extension

from baton.kernels import cpp_build

_HOLDER = """
import sys, time
from pathlib import Path
from baton.kernels.cpp_build import build_turn
folder = Path(sys.argv[1])
with build_turn(folder):
    (folder / "lock").touch()  # torch's lock, as during a build
    print("in", flush=True)
    time.sleep(float(sys.argv[2]))
    (folder / "lock").unlink()
"""


def _hold(folder: Path, seconds: float) -> subprocess.Popen[str]:
    """A process that takes its turn at ``folder`` and keeps it ``seconds`` (printed "in")."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "in"
    return proc


def test_a_lock_left_by_a_dead_build_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()
    with cpp_build.build_turn(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for(tmp_path: Path) -> None:
    holder = _hold(tmp_path, 1.5)
    start = time.monotonic()
    with cpp_build.build_turn(tmp_path):
        waited = time.monotonic() - start
        assert not (tmp_path / "lock").exists()
    holder.wait(timeout=30)
    assert waited > 0.5


def test_a_killed_build_frees_its_turn(tmp_path: Path) -> None:
    holder = _hold(tmp_path, 600)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / "lock").exists()  # what torch alone would wait on for ever
    start = time.monotonic()
    with cpp_build.build_turn(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 5


def test_load_builds_in_its_own_folder_after_clearing_a_stale_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen: dict[str, object] = {}

    def fake_load(**kwargs: object) -> str:
        folder = Path(str(kwargs["build_directory"]))
        seen.update(kwargs, stale=(folder / "lock").exists())
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    first = cpp_build.load_extension("baton_cpu_ops", "cpu_ops.cpp", ["-O3"])
    folder = Path(str(seen["build_directory"]))
    assert first == "module" and folder.parent.parent == tmp_path
    assert folder.name == seen["name"] and folder.name.startswith("baton_cpu_ops_")
    (folder / "lock").touch()
    assert cpp_build.load_extension("baton_cpu_ops", "cpu_ops.cpp", ["-O3"]) == "module"
    assert seen["stale"] is False


def test_checkouts_of_the_same_sources_build_in_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's build file names the sources by path: one folder shared by two checkouts was
    # rebuilt by each in turn.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    names: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: names.append(kw["name"]))
    cpp_build.load_extension("baton_cpu_ops", "cpu_ops.cpp", ["-O3"])
    other = tmp_path / "checkout" / "csrc"
    shutil.copytree(cpp_build.CSRC, other)
    monkeypatch.setattr(cpp_build, "CSRC", other)
    cpp_build.load_extension("baton_cpu_ops", "cpu_ops.cpp", ["-O3"])
    cpp_build.load_extension("baton_cpu_ops", "cpu_ops.cpp", ["-O3"])
    assert names[0] != names[1] and names[1] == names[2]


def test_runnable_isas_keep_the_extensions_and_torchs_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Ext:
        @staticmethod
        def isa_supported(code: int) -> bool:
            return code != 2  # this CPU lacks the third

    names = ("avx2", "avx512", "avx512vnni", "avx512bf16")
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert cpp_build.runnable_isas(Ext(), names) == ("avx2", "avx512", "avx512bf16")
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    assert cpp_build.runnable_isas(Ext(), names) == ("avx2",)
