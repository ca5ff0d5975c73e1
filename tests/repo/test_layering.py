"""The import direction rules written in docs/design.md, checked on the source.

Every ``import`` in every product module counts (top level, inside functions, and under
``TYPE_CHECKING``): a rule that only holds at run time still lets a cycle in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

from baton.bench.readme.import_graph import imported_names, module_name

PACKAGES = ("engine", "grammar", "sampler", "kernels", "bench")

# The rooms of engine/ and what each may import of engine/. "shared" is engine/'s top-level
# modules (config, sampling params, outputs, hand-off values, tokenizer, sync check): both
# sides import them, and they import no room.
ENGINE_ROOMS: dict[str, set[str]] = {
    "shared": {"shared"},
    "core": {"shared", "executor.base"},  # the interface only, never an implementation
    "executor": {"shared", "executor", "worker", "models"},
    "worker": {"shared", "worker", "models"},
    "models": {"shared", "models"},
    "loader": {"shared", "loader", "models"},
    "processing": {"shared", "processing", "core", "executor", "worker", "loader"},
    "cli": {"shared", "cli", "entrypoints", "server"},
    "entrypoints": {"shared", "entrypoints", "processing", "loader"},
    "server": {"shared", "server", "entrypoints", "loader"},
}
# What each top-level package may import of baton.
PACKAGE_RULES: dict[str, set[str]] = {
    "engine": {"engine", "grammar", "sampler", "kernels"},
    "grammar": {"grammar"},
    "sampler": {"sampler", "kernels"},
    "kernels": {"kernels"},
    "bench": set(PACKAGES),
}
# grammar/'s backend folders: each holds its adapter and its own schema rewrites, and only its
# own modules import it (the compile workers load a backend by its recipe string); what more
# than one backend uses lives beside them (grammar/*.py, grammar/schema/).
GRAMMAR_BACKENDS = ("xgrammar", "outlines", "guidance")


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _engine_room(module: str) -> str | None:
    """The room of an engine module ("shared" for engine/'s top-level modules)."""
    parts = module.split(".")
    if parts[:2] != ["baton", "engine"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ENGINE_ROOMS else "shared"


def _allowed_in_engine(importer_room: str, target: str) -> bool:
    rest = target.split(".")[2:]
    if not rest:
        return True  # the lazy public facade `baton.engine`
    target_room = rest[0] if rest[0] in ENGINE_ROOMS else "shared"
    allowed = ENGINE_ROOMS[importer_room] | {importer_room}
    return target_room in allowed or ".".join(rest[:2]) in allowed


def _allowed_in_grammar(importer: str, target: str) -> bool:
    """Whether a grammar module may import ``target``: a backend folder only from itself."""
    folder = target.split(".")[2:3]
    if folder and folder[0] in GRAMMAR_BACKENDS:
        return importer.split(".")[2:3] == folder
    return True


def _violations() -> list[str]:
    bad = []
    for path in _modules():
        me = module_name(ROOT, path)
        if me == "baton.engine":
            continue  # the facade re-exports from every room, lazily
        pkg = me.split(".")[1]
        room = _engine_room(me)
        for target in sorted(imported_names(path)):
            target_pkg = target.split(".")[1]
            if target_pkg not in PACKAGE_RULES[pkg]:
                bad.append(f"{me} imports {target} ({pkg}/ must not import {target_pkg}/)")
            elif (
                room is not None and target_pkg == "engine" and not _allowed_in_engine(room, target)
            ):
                bad.append(f"{me} imports {target} (engine room {room!r} must not)")
            elif pkg == "grammar" and not _allowed_in_grammar(me, target):
                bad.append(f"{me} imports {target} (only its own backend folder may)")
    return bad


def test_imports_point_one_way() -> None:
    assert _violations() == []


def _names_bench(path: Path) -> list[str]:
    """Strings in a module that name ``baton.bench`` (an ``importlib.import_module`` target
    escapes the import rules above)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "baton.bench" in node.value
    ]


def test_the_product_never_names_bench() -> None:
    # baton.bench is the baton-bench distribution, absent from an install for serving: the
    # product reaches `baton bench` only through the `baton.cli_plugins` entry point group.
    product = [p for p in _modules() if p.relative_to(ROOT).parts[0] != "bench"]
    assert [hit for path in product for hit in _names_bench(path)] == []


def test_the_checker_catches_a_wrong_import(tmp_path: Path) -> None:
    fake = tmp_path / "m.py"
    fake.write_text("from baton.engine.core.scheduler import Scheduler\nimport baton.engine\n")
    assert imported_names(fake) == {
        "baton.engine.core.scheduler",
        "baton.engine.core.scheduler.Scheduler",
        "baton.engine",
    }
    assert not _allowed_in_engine("worker", "baton.engine.core.scheduler")
    assert not _allowed_in_engine("core", "baton.engine.worker.model_runner")
    assert not _allowed_in_engine("shared", "baton.engine.core.request")
    assert _allowed_in_engine("core", "baton.engine.executor.base")
    assert not _allowed_in_engine("core", "baton.engine.executor.uni")
    assert not _allowed_in_grammar("baton.grammar.schema.merge", "baton.grammar.xgrammar.keywords")
    assert not _allowed_in_grammar("baton.grammar.outlines.faithful", "baton.grammar.xgrammar")
    assert not _allowed_in_grammar("baton.grammar.validation", "baton.grammar.guidance.backend")
    assert _allowed_in_grammar("baton.grammar.xgrammar.backend", "baton.grammar.xgrammar.keywords")
    assert _allowed_in_grammar("baton.grammar.outlines.backend", "baton.grammar.schema.refs")
    fake.write_text('import importlib\nimportlib.import_module(f"baton.bench.{name}")\n')
    assert _names_bench(fake) != []


@pytest.mark.parametrize("room", sorted(set(ENGINE_ROOMS) - {"shared"}))
def test_every_room_is_a_package(room: str) -> None:
    assert (ROOT / "engine" / room / "__init__.py").is_file()


def test_no_module_imports_itself_through_others() -> None:
    # A cycle holds at run time only by the order of first imports; every import counts here
    # (inside functions and under TYPE_CHECKING too), bench/ included.
    from baton.bench.readme.import_graph import cycles, module_graph

    graph = module_graph(ROOT)
    assert len(graph) > 150  # the whole tree was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_each_cycle_and_the_rooms_their_floors() -> None:
    from baton.bench.readme.import_graph import cycles, room_graph

    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    found = cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}})
    assert sorted(sorted(c) for c in found) == [["a", "b"], ["c", "d"]]
    rooms = room_graph(
        {
            "baton.engine.server.app": {"baton.engine.core.scheduler"},
            "baton.engine.core.scheduler": {"baton.kernels.rope"},
            "baton.kernels.rope": set(),
        }
    )
    assert rooms.floors == {"engine.server": 2, "engine.core": 1, "kernels": 0}
    assert rooms.back_arrows == [] and rooms.room_cycles == []
