"""One fixed micro-benchmark of host speed, for moving host costs between machines.

The simulated accelerator charges the model runner's host work per step from costs measured on
the machine that ran the GPU check (``executor/sim_runner.py``). That machine's CPU is not this
one, so a cost measured there is scaled by how fast this host runs the same kind of work. The
kind of work: a runner step's host side is Python bookkeeping plus many small tensor ops, each
bound by torch's dispatcher rather than by arithmetic; so is the engine's own step. The
benchmark does a fixed amount of both and reports its time; the GPU check records it there,
and the ratio of the two is the scale.
"""

from __future__ import annotations

import functools
import time

import torch

# Rounds of the fixed work; about 19 ms a repeat on a 2-core AMD EPYC (2026-12-06).
_ROUNDS = 2000
_REPEATS = 5


def _fixed_work(buf: torch.Tensor, idx: torch.Tensor, table: dict[int, list[int]]) -> int:
    """One repeat: per round, a few small tensor ops (dispatcher-bound, like a runner's input
    preparation) and a dict-and-list walk (like the scheduler's per-request loop)."""
    acc = 0
    for r in range(_ROUNDS):
        out = buf.index_select(0, idx)
        buf[idx] = out + 1
        acc += int(out.shape[0])
        for key, values in table.items():
            if values[-1] > r:
                acc += key
            values.append(values.pop())
    return acc


def measure_host_speed(repeats: int = _REPEATS) -> float:
    """Seconds the fixed work takes on this host (the least of ``repeats`` runs, so that a
    run disturbed by another process counts as little as possible). Runs in the calling
    thread; no side effects.

    Raises:
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    buf = torch.zeros(64, 16, dtype=torch.int64)
    idx = torch.arange(0, 64, 2)
    table = {k: list(range(k, k + 8)) for k in range(32)}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            _fixed_work(buf, idx, table)
            best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def host_speed_seconds() -> float:
    """``measure_host_speed()``, measured once per process."""
    return measure_host_speed()
