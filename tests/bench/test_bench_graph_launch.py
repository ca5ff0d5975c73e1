"""Tests of bench/gpu/graph_launch.py's arithmetic and report (the measurement needs CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton.bench.gpu import graph_launch as gl
from baton.bench.gpu.gpu_check import collect
from baton.bench.gpu.gpu_report import gpu_check_table


def _rows() -> list[dict[str, float]]:
    # idle grows 0.5 us a node, same 2 us a node, the others not at all.
    return [
        {
            "nodes": n,
            "idle": 5 + 0.5 * n,
            "busy": 7.0,
            "same": 10 + 2 * n,
            "other": 9.0,
            "eager_per_kernel": 4.0,
        }
        for n in (10, 100, 400)
    ]


def test_per_node_cost_is_the_slope_over_node_counts() -> None:
    rows = _rows()
    assert gl.per_node_us(rows, "idle") == pytest.approx(0.5)
    assert gl.per_node_us(rows, "same") == pytest.approx(2.0)
    assert gl.per_node_us(rows, "other") == pytest.approx(0.0)
    assert gl.per_node_us(rows[:1], "idle") is None


def test_table_lists_every_row_and_the_slopes() -> None:
    text = gl.table(_rows())
    assert "  400 " in text and "same 2.000" in text and "idle 0.500" in text


def test_kinds_table_lists_each_kind_and_the_engine_graph() -> None:
    kinds = [
        {"kind": "gemm", "nodes": 320, "idle": 400.0, "same": 410.0},
        {"kind": "triton", "nodes": 320, "idle": 20.0, "same": 15.0},
    ]
    engine = {
        "batch": 32,
        "nodes": 321,
        "idle": 500.0,
        "same": 520.0,
        "node_kinds": {"KERNEL": 320, "MEMCPY": 1},
    }
    text = gl.kinds_table(kinds, engine)
    assert "gemm" in text and "400.0" in text and "engine b32" in text
    assert "KERNEL 320, MEMCPY 1" in text
    assert "engine" not in gl.kinds_table(kinds, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_nothing_is_measured(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "g.json"
    assert gl.main(["--out", str(out)]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out and not out.exists()


def test_the_gpu_check_collects_and_renders_it(tmp_path: Path) -> None:
    src = tmp_path / "out"
    src.mkdir()
    env = {"device": "H200", "torch": "2.11", "cuda": "13.0", "python": "3.12"}
    (src / "env.json").write_text(json.dumps(env))
    rows = _rows()
    per_node = {s: gl.per_node_us(rows, s) for s in gl.SITUATIONS}
    (src / "graph_launch.json").write_text(json.dumps({"rows": rows, "per_node_us": per_node}))
    data = collect(src, tmp_path / "gpu_check.json")
    text = gpu_check_table(data)
    assert "400 nodes idle 205 us, busy 7 us, same 810 us, other 9 us" in text
    assert "per node: idle 0.50 us" in text and "same 2.00 us" in text


def test_node_kinds_are_counted_from_a_dot_file() -> None:
    dot = 'n0 [label="KERNEL\\n_rms_norm_kernel"]\nn1 [label="KERNEL"]\nn2 [label="MEMCPY"]'
    assert gl.count_node_kinds(dot) == {"KERNEL": 2, "MEMCPY": 1}
    assert gl.count_node_kinds("digraph {}") == {}
