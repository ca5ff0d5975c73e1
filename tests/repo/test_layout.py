"""tests/ follows the package (tests/layout.py): every test file sits in the folder of the package
it tests or in tests/repo/, no file name is used twice, one conftest.py and no __init__.py, every
path in the repository that names a test file names where it is, and the shared fixtures reach
every folder."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import layout
import pytest
from conftest import REAL_AUTO_DTYPE, ROOT, TEST_KV_CACHE_BYTES

import baton.engine.config as engine_config_module


def test_every_test_file_is_in_its_room() -> None:
    problems = layout.misplaced()
    assert problems == [], "run `python tests/layout.py --apply`:\n" + "\n".join(problems)


def test_no_path_in_the_repository_names_a_test_file_where_it_is_not() -> None:
    stale = [f"{p.relative_to(ROOT)}: {old} is {new}" for p, old, new in layout.stale_references()]
    assert stale == [], "run `python tests/layout.py --fix-refs`:\n" + "\n".join(stale)


def test_the_table_and_the_prefixes_name_rooms_and_the_files_are_in_theirs() -> None:
    rooms = layout.rooms()
    assert {"engine/core", "engine/server", "grammar", "kernels", "bench", "repo"} <= rooms
    assert set(layout.PLACES.values()) | {room for _, room in layout.PREFIXES} <= rooms
    for path in layout.test_files():
        room = path.parent.relative_to(layout.TESTS).as_posix()
        if path.name in layout.PLACES:
            assert layout.PLACES[path.name] == room, path.name


def _tree(root: Path, files: list[str]) -> Path:
    """A made-up repository: its file names must never be real ones (--fix-refs would rewrite
    them here, and a table entry would change their room)."""
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root / "tests"


def test_each_break_of_the_layout_is_reported(tmp_path: Path) -> None:
    tests = _tree(
        tmp_path,
        [
            "engine/__init__.py",
            "engine/core/__init__.py",
            "kernels/__init__.py",
            "tests/engine/core/test_made_up_fine.py",
            "tests/kernels/test_kernels_made_up_ok.py",
            "tests/test_kernels_made_up_new.py",
            "tests/misc/test_made_up_lost.py",
            "tests/engine/test_made_up_fine.py",
            "tests/conftest.py",
            "tests/kernels/conftest.py",
            "tests/kernels/__init__.py",
        ],
    )
    assert layout.misplaced(tests, tmp_path) == [
        "tests/misc/test_made_up_lost.py: misc is no package folder",
        "tests/test_kernels_made_up_new.py: at the top of tests/ (its room: tests/kernels/)",
        "test_made_up_fine.py: used 2 times in tests/",
        "tests/kernels/conftest.py: tests/ has one conftest.py and no __init__.py",
        "tests/kernels/__init__.py: tests/ has one conftest.py and no __init__.py",
    ]
    assert not layout.misplaced(_tree(tmp_path / "ok", ["engine/__init__.py"]), tmp_path / "ok")


@pytest.mark.parametrize(
    ("name", "room"),
    [
        ("test_scheduler.py", "engine/core"),  # the table
        ("test_worker_start.py", "engine/executor"),  # the table before the prefix
        ("test_kernels_made_up.py", "kernels"),
        ("test_server_made_up.py", "engine/server"),
        ("test_server.py", "engine/server"),
        ("test_core_made_up.py", "engine/core"),
        ("test_grammar_made_up.py", "grammar"),
        ("test_bench_made_up.py", "bench"),
        ("test_made_up_pool.py", None),  # no rule: --apply names it and leaves it
    ],
)
def test_room_for_a_name(name: str, room: str | None) -> None:
    assert layout.room_for(name) == room


def test_a_new_file_without_a_room_is_named_with_a_hint(tmp_path: Path) -> None:
    tests = _tree(tmp_path, ["tests/test_kernels_made_up_x.py", "tests/test_made_up_pool.py"])
    (tests / "test_made_up_pool.py").write_text(
        "from baton.engine.core.block_pool import BlockPool\n"
        "from baton.engine.core.kv_cache_manager import KVCacheManager\n"
        "from baton.engine.config import EngineConfig\n"
    )
    moves, homeless = layout.plan(tests)
    name = "test_kernels_made_up_x.py"
    assert moves == [(tests / name, tests / "kernels" / name)]
    assert homeless == [tests / "test_made_up_pool.py"]
    assert layout.guess_room(tests / "test_made_up_pool.py") == "engine/core"


def test_the_shared_fixtures_and_helpers_reach_every_folder() -> None:
    # The autouse fixtures of tests/conftest.py apply here, two folders down.
    assert engine_config_module.auto_dtype is not REAL_AUTO_DTYPE
    kv_bytes = inspect.signature(engine_config_module.EngineConfig).parameters
    assert kv_bytes["kv_cache_memory_bytes"].default == TEST_KV_CACHE_BYTES
    # Every test folder is importable by module name, whichever files this run collected.
    for folder in {path.parent for path in layout.test_files()}:
        assert str(folder) in sys.path, folder
