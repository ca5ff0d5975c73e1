"""The model runner's host laps (engine/worker/host_times.py): off by default, and with
BATON_RUNNER_TIMES=1 a time for every part of a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.bench.gpu.gpu_profile import runner_laps
from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.worker.host_times import RUNNER_TIMES_ENV, HostTimes

PARTS = {
    "apply_changes",
    "plan_and_copy",
    "forward",
    "logits",
    "grammar",
    "bans_and_metadata",
    "sampler",
    "record",
    "to_host",
}


def test_laps_add_the_time_since_the_last_mark_to_each_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([1.0, 1.5, 3.5, 10.0, 10.25])
    monkeypatch.setattr("baton.engine.worker.host_times.time.perf_counter", lambda: next(clock))
    laps = HostTimes(enabled=True)
    laps.start()
    laps.lap("a")
    laps.lap("b")
    laps.start()
    laps.lap("a")
    assert laps.snapshot() == {"a": 0.75, "b": 2.0}
    off = HostTimes(enabled=False)
    off.start()
    off.lap("a")
    assert off.snapshot() == {}


def test_off_unless_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNNER_TIMES_ENV, raising=False)
    assert not HostTimes().enabled
    monkeypatch.setenv(RUNNER_TIMES_ENV, "1")
    assert HostTimes().enabled


def test_an_engine_built_with_it_times_every_part_of_its_steps(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUNNER_TIMES_ENV, "1")
    llm = LLM(str(tiny_model_dir), executor="uni", max_model_len=256)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        params = [
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            SamplingParams(
                max_tokens=12,
                temperature=0.0,
                structured_outputs=StructuredOutputsParams(json=schema),
            ),
        ]
        outs = llm.generate(["Hi", "JSON:"], params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason != "error" for o in outs)
        times = llm.engine.core.executor.runner.host_times.snapshot()
        assert runner_laps(llm) == times  # what bench/gpu/gpu_profile.py reads
    finally:
        llm.shutdown()
    assert set(times) == PARTS and all(t > 0 for t in times.values())
