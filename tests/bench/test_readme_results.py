"""The results tables of docs/results.md and the README's headline table are rendered from
bench/results, never typed by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ROOT

from baton.bench.readme.readme_results import (
    BEGIN,
    END,
    HEADLINE_BEGIN,
    HEADLINE_END,
    README,
    RESULTS_PAGE,
    main,
    render,
    render_headline,
    update_readme,
    update_results_page,
)


def test_results_page_matches_the_result_files(tmp_path: Path) -> None:
    copy = tmp_path / "results.md"
    shutil.copy(RESULTS_PAGE, copy)
    changed = update_results_page(copy)
    assert not changed, "docs/results.md is stale: run python -m baton.bench.readme.readme_results"


def test_readme_headline_matches_the_result_files(tmp_path: Path) -> None:
    copy = tmp_path / "README.md"
    shutil.copy(README, copy)
    changed = update_readme(copy)
    assert not changed, (
        "README's headline table is stale: run python -m baton.bench.readme.readme_results"
    )


def test_each_page_links_the_plots_from_its_own_folder() -> None:
    page, headline = RESULTS_PAGE.read_text(), README.read_text()
    assert "](../bench/results/" in page and "](bench/results/" not in page
    assert "](bench/results/peers.png)" in headline and "](../bench/results/" not in headline
    # The headline is one of the page's sections, not a table of its own.
    section = render_headline().split("### ", 1)[1].replace("](bench/", "](../bench/")
    assert section in render()


def test_render_reads_only_existing_files_and_flags_unreadable_ones(tmp_path: Path) -> None:
    (tmp_path / "forward.json").write_text('{"rows": [{"case": "decode b=1"}]}')
    text = render(tmp_path)
    assert "Forward pass, float32" in text and "cannot render forward.json" in text
    assert "Offline throughput" not in text
    assert "Forward pass" not in render_headline(tmp_path)


def test_update_needs_markers(tmp_path: Path) -> None:
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text("no markers here")
    page.write_text("no markers here")
    with pytest.raises(ValueError, match="headline:begin"):
        update_readme(readme)
    with pytest.raises(ValueError, match="results:begin"):
        update_results_page(page)
    page.write_text(f"a\n{BEGIN}\nold\n{END}\nb")
    assert update_results_page(page, tmp_path)
    assert "old" not in page.read_text() and page.read_text().endswith("\nb")
    readme.write_text(f"a\n{HEADLINE_BEGIN}\nold\n{HEADLINE_END}\nb")
    assert update_readme(readme, tmp_path)
    assert "old" not in readme.read_text() and readme.read_text().endswith("\nb")


def test_main_writes_both_files_and_then_nothing(tmp_path: Path) -> None:
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text(f"{HEADLINE_BEGIN}\n{HEADLINE_END}\n")
    page.write_text(f"{BEGIN}\n{END}\n")
    (tmp_path / "peers.json").write_text("{}")
    args = ["--readme", str(readme), "--page", str(page), "--results", str(tmp_path)]
    assert main(args) == 0
    assert "cannot render peers.json" in readme.read_text()
    assert "cannot render peers.json" in page.read_text()
    before = (readme.read_text(), page.read_text())
    main(args)
    assert (readme.read_text(), page.read_text()) == before


def test_one_renderer_draws_every_table() -> None:
    from baton.bench.tables import COMPACT, Column, section, string, table, text

    rows = [{"name": "a", "n": 1}, {"name": "b", "n": 22}]
    columns = (Column("name", string("name")), Column("n", text("n")))
    assert table(rows, columns) == "| name | n |\n| --- | --- |\n| a | 1 |\n| b | 22 |"
    assert table(rows, columns, COMPACT).splitlines()[1] == "|---|---|"
    assert section("Caption.\n\n", "T1", "T2") == "Caption.\n\nT1\n\nT2"
    assert section("", "T", notes=["- met: x"]) == "T\n\n- met: x"
    # A string cell that is not one fails the table, and the page says it cannot render the file.
    with pytest.raises(TypeError):
        table([{"name": None, "n": 1}], columns)
    # No table module of bench/ joins Markdown rows by hand any more.
    modules = (ROOT / "bench").glob("*.py")
    hand_made = [
        p.name
        for p in modules
        if p.name != "tables.py" and any(rule in p.read_text() for rule in ('"|---|', '"| --- |'))
    ]
    assert hand_made == []
