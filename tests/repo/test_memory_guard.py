"""tests/memory_guard.py: the suite's bound on a pytest process's resident memory per file, and
the test-wide defaults that keep it there (issue 52)."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import memory_guard
import pytest
from conftest import TEST_KV_CACHE_BYTES

from baton.engine.config import EngineConfig

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc (Linux only)"
)


@linux_only
def test_status_reads_this_process_and_the_peak_can_be_reset() -> None:
    before = memory_guard.status_bytes()
    assert 0 < before["VmRSS"] <= before["VmHWM"]
    block = b"\x01" * (256 << 20)  # every byte written: resident until freed
    assert memory_guard.status_bytes()["VmHWM"] >= before["VmRSS"] + (200 << 20)
    del block
    memory_guard.trim_heap()
    if not memory_guard.reset_peak():
        pytest.skip("this kernel cannot reset the peak (/proc/self/clear_refs)")
    after = memory_guard.status_bytes()
    # The new window starts at what is resident now, not at the 256 MB block's peak.
    assert after["VmHWM"] < before["VmRSS"] + (200 << 20)


def _item(nodeid: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid)


def _teardown(guard: memory_guard.MemoryGuard, nodeid: str) -> None:
    """Drives the guard's teardown wrapper as pytest would, around a teardown that passed."""
    hook = guard.pytest_runtest_teardown(_item(nodeid), None)
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(None)


@linux_only
def test_a_process_over_the_bound_fails_naming_the_file_once(tmp_path: Path) -> None:
    guard = memory_guard.MemoryGuard(limit=1 << 20, log=tmp_path / "rss.jsonl")
    assert guard.enabled
    guard.file = "tests/sampler/test_big.py"
    with pytest.raises(MemoryError, match=r"tests/sampler/test_big\.py: .* over the suite's bound"):
        _teardown(guard, "tests/sampler/test_big.py::test_one")
    # Once per file: the next test of the same file is not failed for the same peak.
    _teardown(guard, "tests/sampler/test_big.py::test_two")
    # Under the bound nothing fails.
    roomy = memory_guard.MemoryGuard(limit=1 << 50, log=None)
    roomy.file = "tests/grammar/test_small.py"
    _teardown(roomy, "tests/grammar/test_small.py::test_one")


@linux_only
def test_each_file_is_recorded_with_its_peak(tmp_path: Path) -> None:
    log = tmp_path / "rss.jsonl"
    guard = memory_guard.MemoryGuard(limit=0, log=log)
    for nodeid, nextid in (
        ("tests/kernels/test_a.py::t1", "tests/kernels/test_a.py::t2"),
        ("tests/kernels/test_a.py::t2", None),
    ):
        hook = guard.pytest_runtest_protocol(_item(nodeid), nextid and _item(nextid))
        next(hook)
        with pytest.raises(StopIteration):
            hook.send(True)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["file"] for line in lines] == ["tests/kernels/test_a.py"]
    assert lines[0]["peak"] >= lines[0]["rss_after"] > 0
    assert {"children", "children_rss", "children_max_hwm", "seconds"} <= set(lines[0])


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory_guard.LIMIT_ENV, raising=False)
    assert memory_guard.limit_bytes() == 4 << 30
    monkeypatch.setenv(memory_guard.LIMIT_ENV, "2.5")
    assert memory_guard.limit_bytes() == int(2.5 * (1 << 30))
    monkeypatch.setenv(memory_guard.LIMIT_ENV, "0")
    assert memory_guard.limit_bytes() == 0


def test_engines_of_the_suite_get_a_small_kv_cache_by_default() -> None:
    # The product's default stays what it was; only the suite's engines get less.
    field = EngineConfig.__dataclass_fields__["kv_cache_memory_bytes"]
    assert isinstance(field, dataclasses.Field) and field.default == 1 << 30
    assert EngineConfig().kv_cache_memory_bytes == TEST_KV_CACHE_BYTES < field.default
    assert EngineConfig(kv_cache_memory_bytes=1 << 20).kv_cache_memory_bytes == 1 << 20


@linux_only
def test_a_file_that_left_a_frozen_cycle_behind_gets_it_back() -> None:
    """An engine dropped without shutdown leaves its objects frozen out of the collector's
    passes (engine/gc_heap.py) and in reference cycles: the end of the file frees them."""
    start = memory_guard.status_bytes()["VmRSS"]
    cycle: list[object] = [b"\x02" * (400 << 20)]
    cycle.append(cycle)
    gc.freeze()  # as an engine's start does
    del cycle
    gc.collect()
    assert memory_guard.status_bytes()["VmRSS"] > start + (300 << 20)  # frozen: not collected
    memory_guard.release_memory(start)
    assert memory_guard.status_bytes()["VmRSS"] < start + (100 << 20)
