"""Matplotlib set up for the benchmarks' PNGs (headless); optional."""

from __future__ import annotations

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
