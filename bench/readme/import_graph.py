"""The import graph of baton's packages, read from the source, drawn room by room.

Every ``import`` of every module counts (top level, inside functions, under ``TYPE_CHECKING``),
as ``tests/repo/test_layering.py`` counts them. Modules are grouped into rooms: engine/'s rooms
(``engine.core``, ``engine.worker``, ...; engine/'s top-level modules are ``engine.shared``),
grammar/'s folders (``grammar.xgrammar``, ``grammar.schema``, ...; its top-level modules are
``grammar``), and ``sampler`` and ``kernels`` (``bench`` imports them all and is left out
of the picture; its cycles are counted). The picture puts each room on the
floor of its longest import chain (rooms that import nothing at the bottom) and draws one arrow
per pair of rooms, as thick as the imports between them; an arrow that goes up or sideways
within a cycle is red. Its title counts module cycles, room cycles and back-arrows: all three
are 0 when the floors hold.

    python -m baton.bench.readme.import_graph [--out docs/imports.png]
"""

from __future__ import annotations

import argparse
import ast
import graphlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from baton.bench.plotting import pyplot

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "grammar", "sampler", "kernels", "bench")
PRODUCT = ("engine", "grammar", "sampler", "kernels")  # the picture's: bench imports them all
OUT = ROOT / "docs" / "imports.png"


def module_name(root: Path, path: Path) -> str:
    """``baton.<dotted path>`` of a source file under ``root`` (a package: its folder's)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["baton", *parts])


def imported_names(path: Path) -> set[str]:
    """Every ``baton.*`` name a module imports: modules, and ``module.name`` for each name
    taken from one (which may be a submodule), wherever the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("baton.")}


def module_graph(root: Path = ROOT, packages: Sequence[str] = PACKAGES) -> dict[str, set[str]]:
    """Each module of ``packages`` and the modules it imports (an imported name resolved to
    the module that defines it; itself left out)."""
    paths = {module_name(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in sorted(paths.items()):
        targets = set()
        for name in imported_names(path):
            while name not in paths and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in paths and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: one cycle at a time, each removed (its first edge
    dropped) before the next is looked for; empty when the graph is a DAG."""
    edges = {node: set(targets) for node, targets in graph.items()}
    found = []
    while True:
        try:
            tuple(graphlib.TopologicalSorter(edges).static_order())
            return found
        except graphlib.CycleError as exc:
            cycle = list(exc.args[1])
            found.append(cycle[:-1])
            edges[cycle[1]].discard(cycle[0])  # the sorter lists a cycle against the arrows


def room_of(module: str) -> str:
    """The room of a module (``engine.core``, ``engine.shared``, ``grammar.schema``, ...)."""
    parts = module.split(".")[1:]
    pkg = parts[0]
    if pkg == "engine":
        if len(parts) > 2 or (len(parts) == 2 and _is_package(parts)):
            return f"engine.{parts[1]}"
        return "engine.shared"
    if pkg == "grammar" and len(parts) > 2:
        return f"grammar.{parts[1]}"
    return pkg


def _is_package(parts: list[str]) -> bool:
    return (ROOT.joinpath(*parts) / "__init__.py").is_file()


@dataclass(frozen=True)
class RoomGraph:
    """Imports between rooms: ``edges[(a, b)]`` modules-imports from room a into room b."""

    edges: Counter[tuple[str, str]]
    floors: dict[str, int]  # a room's floor: its longest import chain
    module_cycles: list[list[str]]
    room_cycles: list[list[str]]

    @property
    def back_arrows(self) -> list[tuple[str, str]]:
        """Imports from a room into one on its own floor or above."""
        return sorted(e for e in self.edges if self.floors[e[0]] <= self.floors[e[1]])


def room_graph(graph: dict[str, set[str]]) -> RoomGraph:
    """``graph``'s modules grouped into rooms (``room_of``), with floors and cycles."""
    edges: Counter[tuple[str, str]] = Counter()
    for module, targets in graph.items():
        for target in targets:
            a, b = room_of(module), room_of(target)
            if a != b:
                edges[(a, b)] += 1
    rooms = sorted({room_of(m) for m in graph})
    by_room = {r: {b for a, b in edges if a == r} for r in rooms}
    floors: dict[str, int] = {}
    room_cycles = cycles(by_room)
    acyclic = {r: set(t) for r, t in by_room.items()}
    for cycle in room_cycles:
        acyclic[cycle[1]].discard(cycle[0])
    for room in graphlib.TopologicalSorter(acyclic).static_order():
        floors[room] = 1 + max((floors[t] for t in acyclic[room]), default=-1)
    return RoomGraph(edges, floors, cycles(graph), room_cycles)


def _positions(floors: dict[str, int]) -> dict[str, tuple[float, float]]:
    by_floor: dict[int, list[str]] = {}
    for room, floor in sorted(floors.items()):
        by_floor.setdefault(floor, []).append(room)
    pos = {}
    for floor, rooms in by_floor.items():
        for i, room in enumerate(rooms):
            pos[room] = ((i + 1) / (len(rooms) + 1), float(floor))
    return pos


def draw(rooms: RoomGraph, out: Path, modules: int) -> None:
    """Writes the picture of ``rooms`` to ``out`` (PNG), ``modules`` counted in its title."""
    plt = pyplot()
    if plt is None:
        return
    pos = _positions(rooms.floors)
    top = max(rooms.floors.values())
    fig, ax = plt.subplots(figsize=(12, 1.4 * (top + 2)))
    back = set(rooms.back_arrows)
    for (a, b), count in sorted(rooms.edges.items()):
        (x0, y0), (x1, y1) = pos[a], pos[b]
        colour = "tab:red" if (a, b) in back else "0.55"
        ax.annotate(
            "",
            xy=(x1, y1 + 0.18),
            xytext=(x0, y0 - 0.18),
            arrowprops=dict(arrowstyle="-|>", lw=0.4 + min(count, 40) / 12, color=colour),
        )
    for room, (x, y) in pos.items():
        ax.text(x, y, room, ha="center", va="center", fontsize=9, bbox=dict(fc="w", ec="0.3"))
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, top + 0.6)
    ax.axis("off")
    ax.set_title(
        f"baton imports: {modules} modules, {sum(rooms.edges.values())} imports between "
        f"{len(pos)} rooms; module cycles {len(rooms.module_cycles)}, room cycles "
        f"{len(rooms.room_cycles)}, back-arrows {len(back)} (arrows point at what is imported)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the cycles (bench's modules included) and back-arrows, if any, and writes the
    picture of the product's rooms; exit status 1 when there are any."""
    p = argparse.ArgumentParser(
        prog="python -m baton.bench.readme.import_graph", description=__doc__
    )
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    module_cycles = cycles(module_graph())
    graph = module_graph(packages=PRODUCT)
    rooms = room_graph(graph)
    problems = [f"module cycle: {' -> '.join(c)}" for c in module_cycles]
    problems += [f"room cycle: {' -> '.join(c)}" for c in rooms.room_cycles]
    problems += [f"back-arrow: {a_} -> {b}" for a_, b in rooms.back_arrows]
    if problems:
        print("\n".join(problems))
    draw(rooms, a.out, len(graph))
    print(f"{len(graph)} modules, {len(rooms.floors)} rooms; wrote {a.out}")
    return int(bool(problems))


if __name__ == "__main__":
    raise SystemExit(main())
