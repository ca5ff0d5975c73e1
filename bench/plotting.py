"""Writing benchmark results: JSON, and a PNG through headless matplotlib (optional)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def save_results(result: dict, out: Path, plot: Callable[[dict, Path], None]) -> None:
    """Writes ``result`` as JSON to ``out`` and its plot beside it (same name, .png)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")
