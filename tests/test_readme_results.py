"""The README's results section is rendered from bench/results, never typed by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from baton.bench.readme_results import BEGIN, END, README, render, update_readme


def test_readme_results_match_the_result_files(tmp_path: Path) -> None:
    copy = tmp_path / "README.md"
    shutil.copy(README, copy)
    changed = update_readme(copy)
    assert not changed, "README results are stale: run python -m baton.bench.readme_results"


def test_render_reads_only_existing_files_and_flags_unreadable_ones(tmp_path: Path) -> None:
    (tmp_path / "forward.json").write_text('{"rows": [{"case": "decode b=1"}]}')
    text = render(tmp_path)
    assert "Forward pass, float32" in text and "cannot render forward.json" in text
    assert "Offline throughput" not in text


def test_update_needs_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers here")
    with pytest.raises(ValueError, match="results:begin"):
        update_readme(readme)
    readme.write_text(f"a\n{BEGIN}\nold\n{END}\nb")
    assert update_readme(readme, tmp_path)
    assert "old" not in readme.read_text() and readme.read_text().endswith("\nb")
