"""``baton bench structured`` at its smallest size on the tiny model: every workload, mode and
batch size is measured like for like, and its outputs are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.bench.offline.structured import StructuredConfig, evaluate_goals, main

SCHEMAS = {
    "a-person.json": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "b-refused.json": {"type": "object", "not": {"required": ["x"]}},  # no backend enforces "not"
    "c-color.json": {"enum": ["red", "green", "blue"]},
}


def test_config_names_a_bad_field() -> None:
    with pytest.raises(ValueError, match="batches"):
        StructuredConfig(batches=(0,))
    with pytest.raises(ValueError, match="rounds"):
        StructuredConfig(rounds=0)
    with pytest.raises(ValueError, match="modes"):
        StructuredConfig(modes=("fast",))
    with pytest.raises(ValueError, match="workloads"):
        StructuredConfig(workloads=("toy",))
    with pytest.raises(ValueError, match="worker_threads"):
        StructuredConfig(worker_threads=0)


def test_one_goal_per_workload_and_mode_at_its_worst_batch() -> None:
    rows = [
        {"workload": "peers", "mode": "sync", "batch": 1, "ratio": 1.01},
        {"workload": "peers", "mode": "sync", "batch": 8, "ratio": 1.2},
        {"workload": "shared", "mode": "sync", "batch": 1, "ratio": 0.99},
    ]
    goals = evaluate_goals(rows)
    assert [(g["value"], g["met"]) for g in goals] == [(1.2, False), (0.99, True)]
    assert "worst: batch 8" in goals[0]["goal"]


@pytest.mark.slow
def test_smallest_run_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name, schema in SCHEMAS.items():
        (data / name).write_text(json.dumps({"schema": schema, "tests": []}))
    out = tmp_path / "structured.json"
    argv = ["--model", str(tiny_model_dir), "--batches", "1,3", "--max-tokens", "6"]
    argv += ["--rounds", "1", "--sample", "5", "--data", str(data), "--out", str(out)]
    # One torch thread in the async mode's model worker: with two, beside another busy process
    # on a 2-core machine, every parallel op waits for a descheduled thread.
    argv += ["--worker-threads", "1"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["worker_threads"] == 1
    assert out.with_suffix(".png").stat().st_size > 0
    # The schema no backend enforces is not sampled; the others are.
    assert result["config"]["sample"] == ["a-person.json", "c-color.json"]
    assert result["dropped"] == []
    cases = {(r["workload"], r["mode"], r["batch"]) for r in result["rows"]}
    assert cases == {
        (w, m, b) for w in ("peers", "shared") for m in ("sync", "async") for b in (1, 3)
    }
    for row in result["rows"]:
        assert row["ratio"] > 0 and row["bitmask_ms_per_step"] >= 0
        assert row["invalid"] == [] and row["errors"] == []
        # The structured repeat (after the free run) decodes what the first run did.
        assert row["repeat_same"] == row["requests"]
        # Free runs decode as many tokens as the structured ones (at least 2 per request).
        assert (
            row["structured_tokens"]
            <= row["free_tokens"]
            <= row["structured_tokens"] + 2 * row["batch"]
        )
    assert len(result["goals"]) == 4
    assert result["run"]["commit"] != "unknown"
