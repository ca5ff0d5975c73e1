"""The one Markdown table renderer of the results pages: a table from rows of a result JSON and
its column declarations, the caption + tables + notes shape of a section, and the cells and goal
lines every benchmark's section shares (used by bench/readme/readme_results.py and each benchmark's
``readme_table``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]
# The separator rows in use: "| --- |" per column, or "|---|" (the compact tables).
SPACED, COMPACT = " --- |", "---|"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], rule: str = SPACED) -> str:
    """A Markdown table: the header, one ``rule`` per column, one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + rule * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Column:
    """One column: its header and how a row of the result JSON shows in it."""

    header: str
    cell: Callable[[Row], str]


def fixed(key: str, spec: str) -> Callable[[Row], str]:
    """A cell that formats ``row[key]`` with ``spec``; a missing or None value raises
    (KeyError, TypeError), which the results page reports as a file it cannot render."""
    return lambda r: format(r[key], spec)


def text(key: str) -> Callable[[Row], str]:
    """A cell that shows ``str(row[key])`` (a count, a batch size)."""
    return lambda r: str(r[key])


def string(key: str) -> Callable[[Row], str]:
    """A cell that shows ``row[key]``, a string, as it is; any other value raises TypeError
    when the table is joined (a result the page cannot render)."""
    return lambda r: r[key]


def table(rows: Iterable[Row], columns: Sequence[Column], rule: str = SPACED) -> str:
    """The Markdown table of ``rows`` (dicts of a result JSON), one column per declaration."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    return markdown_table([c.header for c in columns], cells, rule)


def section(caption: str, *blocks: str, notes: Sequence[str] = ()) -> str:
    """A results section's body: the caption (ending in its own blank line, or empty), the
    blocks (tables) one blank line apart, then the notes as lines when there are any."""
    body = caption + "\n\n".join(blocks)
    return body + ("\n\n" + "\n".join(notes) if notes else "")


def pct_cell(value: float | None) -> str:
    """A share as a whole percentage; "-" for none."""
    return "-" if value is None else f"{value:.0%}"


def num_cell(value: float | None, spec: str) -> str:
    """A number in ``spec``'s format; "-" for none."""
    return "-" if value is None else format(value, spec)


def code_cell(value: str) -> str:
    """``value`` as inline code that a Markdown table cell can hold."""
    return "`" + value.replace("`", "'").replace("|", "\\|") + "`"


def goal_lines(goals: list[Any], digits: int = 2) -> list[str]:
    """One line per goal: met, MISSED (with the measured value) or not measured."""
    lines = []
    for g in goals:
        if not isinstance(g, dict):
            continue
        if g.get("value") is None:
            lines.append(f"- not measured: {g['goal']} {g['target']}")
        else:
            verdict = "met" if g["met"] else "MISSED"
            lines.append(f"- {verdict}: {g['goal']} {g['target']}: {g['value']:.{digits}f}")
    return lines


def where_run(result: dict[str, Any]) -> str:
    """Where and when a result was measured: "CPU at commit abcdef1, YYYY-MM-DD" ("?" for
    what its ``run`` record lacks)."""
    run = result.get("run", {})
    commit, date = str(run.get("commit", "?"))[:7], str(run.get("date", "?"))[:10]
    return f"{run.get('cpu', '?')} at commit {commit}, {date}"
