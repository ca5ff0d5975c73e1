"""The engine benchmark end to end at its smallest size, and its ``baton bench engine`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton.engine.cli.main import build_parser
from baton.engine.cli.main import main as cli_main
from baton.engine.config import EngineConfig
from baton.engine.entrypoints.args import config_from_args

ROW_KEYS = {
    "regime",
    "async",
    "json_fraction",
    "batch",
    "tok_per_s",
    "tpot_ms",
    "device_busy",
    "steady_device_busy",
    "deferred_steps",
    "step_wall_ms",
    "step_cpu_ms",
    "step_device_ms",
    "step_over_bound",
    "json_checked",
    "json_invalid",
}


@pytest.mark.slow
def test_bench_engine_smallest_run_writes_every_row(tmp_path: Path) -> None:
    from baton.bench.offline.engine import main

    out = tmp_path / "engine.json"
    argv = ["--regimes", "b", "--batches", "1,2", "--output-len", "4", "--repeats", "1"]
    # One torch thread in each model worker: with two, beside another busy process on a
    # 2-core machine, every parallel op waits for a descheduled thread.
    argv += ["--worker-threads", "1"]
    assert main([*argv, "--goal-batch", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["worker_threads"] == 1
    rows = result["rows"]
    # The dtype each row computed in, and their set in the run's provenance.
    assert {r["dtype"] for r in rows} <= {"float32", "bfloat16"}
    assert result["run"]["dtype"] == ",".join(sorted({r["dtype"] for r in rows}))
    cases = {(r["async"], r["json_fraction"], r["batch"]) for r in rows}
    assert cases == {(a, f, b) for a in (True, False) for f in (0.0, 1.0) for b in (1, 2)}
    for row in rows:
        assert set(row) >= ROW_KEYS
        assert row["regime"] == "b"
        assert row["tok_per_s"] > 0
        assert row["json_invalid"] == 0
        assert 0.0 < row["device_busy"] <= 1.5  # device time can overlap detokenization
    # Free requests ignore EOS: every one of them yields exactly --output-len tokens.
    free = [r for r in rows if r["json_fraction"] == 0.0]
    assert all(r["output_tokens"] == 4 * r["batch"] for r in free)
    # Under async scheduling a batch of JSON requests defers its steps; sync never does.
    assert all(r["deferred_steps"] > 0 for r in rows if r["async"] and r["json_fraction"] == 1.0)
    assert all(r["deferred_steps"] == 0 for r in rows if not r["async"])
    assert len(result["ratios"]["async_over_sync"]) == 4
    assert {t["batch"] for t in result["ratios"]["structured_over_free"]} == {1, 2}
    goals = {g["goal"]: g for g in result["goals"]}
    assert len(goals) == 4
    speedup = next(g for name, g in goals.items() if "throughput" in name)
    assert speedup["value"] is not None and speedup["met"] in (True, False)
    trace = result["step_trace"]
    assert trace["batch"] == 2 and trace["json_fraction"] == 1.0
    assert len(trace["async"]["wall_ms"]) > 0 and len(trace["sync"]["device_ms"]) > 0


def test_worker_threads_is_a_positive_int_for_the_cpu_model_worker() -> None:
    from baton.bench.offline.engine import BenchConfig, main

    with pytest.raises(ValueError, match="worker_threads"):
        BenchConfig(worker_threads=0)
    with pytest.raises(ValueError, match="CPU model worker"):
        BenchConfig(worker_threads=1, device="cuda")
    with pytest.raises(SystemExit) as exc:
        main(["--device", "sim:h200", "--worker-threads", "1"])
    assert exc.value.code == 2


def test_cli_bench_engine_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "engine", "--help"])
    assert exc.value.code == 0
    assert "--batches" in capsys.readouterr().out  # the benchmark's own help, passed through


def test_cli_passes_bench_flags_through_and_rejects_unknown_ones() -> None:
    args, unknown = build_parser().parse_known_args(
        ["bench", "engine", "--regimes", "b", "--batches", "1,2"]
    )
    assert args.command == "bench" and unknown == ["--regimes", "b", "--batches", "1,2"]
    assert (
        build_parser().parse_args(["generate", "hi", "--no-async-scheduling"]).no_async_scheduling
    )
    assert not build_parser().parse_args(["generate", "hi"]).no_async_scheduling
    forced = build_parser().parse_args(["generate", "hi", "--async-scheduling"])
    assert forced.async_scheduling and config_from_args(forced).async_scheduling is True
    plain = config_from_args(build_parser().parse_args(["generate", "hi"]))
    assert plain.async_scheduling == EngineConfig().async_scheduling  # the engine's own choice
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["generate", "hi", "--async-scheduling", "--no-async-scheduling"])
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "hi", "--bogus"])
    assert exc.value.code == 2


def test_cli_import_does_not_load_bench() -> None:
    code = "import sys, baton.engine.cli.main; print('baton.bench' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
