"""``baton bench serve``: the load test against a real ``baton serve`` subprocess (tiny model),
plus its small pure helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from baton.bench.serving.serve import (
    ServeBenchConfig,
    is_structured,
    main,
    parse_metrics,
    percentile,
    served_dtype,
)

ROW_KEYS = {
    "concurrency",
    "issued",
    "done",
    "failed",
    "errors",
    "output_tokens",
    "tok_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "json_requests",
    "json_checked",
    "json_valid_share",
    "json_length_cut",
    "engine_steps",
    "deferred_steps",
}


def process_group_gone(pid: int) -> bool:
    """True when no process of the session the server led is left (its model worker too)."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_load_test_writes_rows_and_stops_the_server(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--concurrency", "1,2", "--requests", "4", "--max-tokens", "8"]
    assert main([*argv, "--out", str(out)]) == 0

    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        assert row.keys() >= ROW_KEYS
        assert row["failed"] == 0 and row["errors"] == {}
        assert row["done"] == row["issued"] == 4
        # Every request ran to max_tokens or stopped; each produced tokens and a first token.
        assert 0 < row["output_tokens"] <= 4 * 8
        assert row["tok_per_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
        assert row["json_requests"] == 2  # json fraction 0.5 of 4
        # Each JSON request either stopped (and was judged) or was cut by max_tokens.
        assert row["json_checked"] + row["json_length_cut"] == 2
        assert row["engine_steps"] > 0
    requests = result["requests"]
    assert len(requests) == 8
    assert all(r["error"] is None and r["output_tokens"] >= 1 for r in requests)
    assert {r["finish_reason"] for r in requests} <= {"stop", "length"}
    assert 0.0 < result["metrics"]["baton_device_busy_fraction"] <= 1.0
    assert result["metrics"]['baton_requests_total{status="error"}'] == 0
    # The dtype the server computed in (--dtype auto resolved there), and the run's provenance.
    assert result["dtype"] in ("float32", "bfloat16") and result["dtype_asked"] == "auto"
    assert result["run"]["dtype"] == result["dtype"] and result["run"]["commit"]

    pid = result["server"]["pid"]
    assert isinstance(pid, int) and process_group_gone(pid)


@pytest.mark.timeout(60)
def test_server_that_fails_to_start_is_reported_with_its_log(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    with pytest.raises(RuntimeError, match="exited with status 2") as info:
        main(["--server-arg=--no-such-option", "--startup-timeout", "50", "--out", str(out)])
    assert "unrecognized arguments" in str(info.value)  # the server's own message, its log
    assert not out.exists()


def test_json_requests_are_spread_by_fraction() -> None:
    assert [is_structured(i, 0.5) for i in range(4)] == [False, True, False, True]
    assert sum(is_structured(i, 0.25) for i in range(8)) == 2
    assert not any(is_structured(i, 0.0) for i in range(8))
    assert all(is_structured(i, 1.0) for i in range(8))


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_served_dtype_comes_from_the_compute_info_labels() -> None:
    text = 'baton_model_compute_info{dtype="bfloat16",dtype_reason="auto: x y"} 1\n'
    assert served_dtype(parse_metrics(text)) == "bfloat16"
    assert served_dtype(parse_metrics("baton_x 1\n")) is None


def test_parse_metrics_keeps_labels_and_skips_comments() -> None:
    text = (
        "# HELP baton_x help\n# TYPE baton_x counter\nbaton_x 3\n"
        'baton_requests_total{status="finished"} 7\nbaton_busy 0.5\n'
    )
    assert parse_metrics(text) == {
        "baton_x": 3.0,
        'baton_requests_total{status="finished"}': 7.0,
        "baton_busy": 0.5,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": ()}, "concurrency"),
        ({"concurrency": (1, 1)}, "repeat"),
        ({"requests": 0}, "requests"),
        ({"json_fraction": 1.5}, "json_fraction"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"time_limit_s": 0.0}, "time_limit_s"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**kwargs)  # type: ignore[arg-type]


def test_default_requests_per_level() -> None:
    cfg = ServeBenchConfig()
    assert cfg.requests_at(1) == 8 and cfg.requests_at(32) == 64
    assert ServeBenchConfig(requests=5).requests_at(32) == 5
