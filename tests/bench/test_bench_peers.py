"""The peers benchmark: its pure parts, a smoke run on a tiny model, its CLI entry."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.bench.offline.peer_runners import Completion, StepRecorder, sequences_from_steps
from baton.bench.offline.peers import (
    SCHEMA,
    CaseMeasure,
    PeersConfig,
    Unit,
    is_valid,
    plan_units,
    resolve_dtypes,
    run_order,
    summarize,
)
from baton.bench.offline.peers_report import compute_ratios, evaluate_goals
from baton.engine.cli.main import main as cli_main

ROW_KEYS = {
    "engine",
    "label",
    "dtype",
    "concurrency",
    "requests",
    "seconds",
    "output_tokens",
    "tok_per_s",
    "tpot_ms",
    "valid",
    "valid_share",
}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": ()}, "concurrency"),
        ({"concurrency": (1, 0)}, "concurrency"),
        ({"concurrency": (2, 2)}, "must not repeat"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"dtypes": ("float16",)}, "dtypes"),
        ({"engines": ("vllm",)}, "engines"),
        ({"repeats": 0}, "repeats"),
    ],
)
def test_config_rejects_bad_fields(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeersConfig(**kwargs)


def test_validity_needs_parse_and_schema() -> None:
    good = '{"name":"Ann","age":40,"city":"Oslo","skills":["bread"]}'
    assert is_valid(good, SCHEMA)
    assert not is_valid(good[:-1], SCHEMA)  # truncated: does not parse
    assert not is_valid(good.replace("40", "400"), SCHEMA)  # parses, breaks maximum
    assert not is_valid("", SCHEMA)


def test_sequences_stop_at_first_eos_and_time_from_the_first_token() -> None:
    rec = StepRecorder()
    rec.put(torch.tensor([[5, 6], [7, 8]]))  # the prompt: not a step
    for tokens in ([10, 20], [2, 21], [2, 22]):
        rec.put(torch.tensor(tokens))
    rec.times = [1.0, 1.5, 2.5]
    (a, tpot_a), (b, tpot_b) = sequences_from_steps(rec, 2, eos_token_ids=(2,))
    assert a == [10, 2] and tpot_a == pytest.approx(0.5)
    assert b == [20, 21, 22] and tpot_b == pytest.approx(0.75)


def test_a_row_takes_the_median_over_the_runs_and_pools_validity() -> None:
    good = '{"name":"Ann","age":40,"city":"Oslo","skills":["bread"]}'
    case = CaseMeasure()
    case.add(2.0, [Completion(good, 10, 0.1), Completion(good[:-1], 6, None)])
    case.add(1.0, [Completion(good, 8, 0.2), Completion(good, 8, 0.3)])
    case.add(4.0, [Completion(good, 12, 0.4), Completion(good, 12, 0.4)])
    row = summarize("baton float32", "baton", "float32", 2, case, SCHEMA)
    assert set(row) >= ROW_KEYS
    assert (row["runs"], row["requests"], row["output_tokens"]) == (3, 6, 56)
    assert row["tok_per_s_runs"] == [8.0, 16.0, 6.0]
    assert (row["tok_per_s_min"], row["tok_per_s"], row["tok_per_s_max"]) == (6.0, 8.0, 16.0)
    # Per run, the mean TPOT of the requests that have one; then the median of the runs.
    assert row["tpot_ms"] == pytest.approx(250.0)
    assert (row["valid"], row["valid_share"]) == (5, pytest.approx(5 / 6))


def _row(engine: str, label: str, c: int, tok_per_s: float, dtype: str) -> dict[str, Any]:
    return {
        "engine": engine,
        "label": label,
        "dtype": dtype,
        "concurrency": c,
        "tok_per_s": tok_per_s,
        "tpot_ms": 1000.0 / tok_per_s,
    }


def test_peers_are_compared_in_the_baton_rows_dtype_and_goals_judge_the_first() -> None:
    rows = [
        _row("baton", "baton bfloat16", 1, 30.0, "bfloat16"),
        _row("baton", "baton bfloat16", 16, 600.0, "bfloat16"),
        _row("baton", "baton float32", 16, 300.0, "float32"),
        _row("transformers", "transformers+xgrammar bfloat16", 1, 20.0, "bfloat16"),
        _row("transformers", "transformers+xgrammar bfloat16", 16, 200.0, "bfloat16"),
        _row("transformers", "transformers+xgrammar float32", 16, 150.0, "float32"),
        _row("outlines", "outlines float32", 16, 50.0, "float32"),
        _row("llama-cpp", "llama-cpp-python", 16, 100.0, "gguf"),
    ]
    ratios = compute_ratios(rows)
    pairs = {(q["baton"], q["peer_label"], q["concurrency"]) for q in ratios}
    assert pairs == {
        ("baton bfloat16", "transformers+xgrammar bfloat16", 1),
        ("baton bfloat16", "transformers+xgrammar bfloat16", 16),
        ("baton bfloat16", "llama-cpp-python", 16),
        ("baton float32", "transformers+xgrammar float32", 16),
        ("baton float32", "outlines float32", 16),
        ("baton float32", "llama-cpp-python", 16),
    }
    cfg = PeersConfig(concurrency=(1, 16), dtypes=("bfloat16", "float32"))
    goals = {
        (g["goal"].split(" / ")[1].split(" ")[0], g["threshold"], g["goal"][-2:]): g
        for g in evaluate_goals(rows, ratios, cfg)
    }
    assert len(goals) == 5
    hf16 = goals[("transformers+xgrammar", 2.0, "16")]
    assert hf16["value"] == pytest.approx(3.0) and hf16["met"] is True
    assert hf16["values"]["baton float32"] == pytest.approx(2.0)
    assert goals[("transformers+xgrammar", 1.2, " 1")]["value"] == pytest.approx(1.5)
    outlines = goals[("outlines", 3.0, "16")]  # no bfloat16 outlines row: not measured
    assert outlines["met"] is None and outlines["values"]["baton float32"] == pytest.approx(6.0)
    llama = goals[("llama-cpp-python", 2.0, "16")]
    assert llama["value"] == pytest.approx(6.0) and llama["met"] is True
    assert goals[("llama-cpp-python", 1.0, " 1")]["met"] is None  # not measured, not failed


def test_units_and_alternating_order() -> None:
    cfg = PeersConfig(dtypes=("bfloat16", "float32"), engines=("baton", "llama-cpp", "outlines"))
    units = plan_units(cfg)
    assert units == [
        Unit("baton", "bfloat16"),
        Unit("baton", "float32"),
        Unit("llama-cpp", "gguf"),
        Unit("outlines", "bfloat16"),
        Unit("outlines", "float32"),
    ]
    assert run_order(units, 0) == units and run_order(units, 1) == units[::-1]
    assert run_order(units, 2) == units
    assert resolve_dtypes(("float32", "float32")) == ("float32",)
    assert set(resolve_dtypes(("auto",))) <= {"float32", "bfloat16"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tiny_run_has_every_row_and_notes_the_missing_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from baton.bench.offline.peers import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed: import fails
    out = tmp_path / "peers.json"
    # One run: the repeats' order and medians are checked above (run_order, summarize); a
    # second run would build baton again (4 s).
    argv = ["--tiny", "--concurrency", "1,2", "--max-tokens", "8", "--repeats", "1"]
    argv += ["--dtypes", "float32"]
    assert main([*argv, "--engines", "baton,transformers,llama-cpp", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["engine"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(e, c) for e in ("baton", "transformers") for c in (1, 2)}
    assert [e["engine"] for e in result["engines"]] == ["baton", "transformers"]
    assert result["run"]["commit"] and result["run"]["dtype"] == "float32"
    for (_, c), row in rows.items():
        assert set(row) >= ROW_KEYS
        assert row["runs"] == 1 and row["requests"] == c
        assert row["tok_per_s_min"] == row["tok_per_s"] == row["tok_per_s_max"]
        assert 0 < row["output_tokens"] <= 8 * c
        assert row["tok_per_s"] > 0 and row["tpot_ms"] > 0
        assert 0 <= row["valid"] <= c and 0.0 <= row["valid_share"] <= 1.0
    assert {(q["peer"], q["concurrency"]) for q in result["ratios"]} == {
        ("transformers", 1),
        ("transformers", 2),
    }
    assert [s["engine"] for s in result["skipped"]] == ["llama-cpp"]
    assert "llama_cpp" in result["skipped"][0]["reason"]
    assert len(result["goals"]) == 5
    measured = [g for g in result["goals"] if "transformers" in g["goal"]]
    assert all(g["value"] is not None and g["met"] in (True, False) for g in measured)


def test_cli_bench_peers_help_passes_through(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "peers", "--help"])
    assert exc.value.code == 0
    assert "--concurrency" in capsys.readouterr().out
