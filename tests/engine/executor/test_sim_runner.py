"""The simulated device's runner costs: the model (what a step is, what it costs), the executor
spending them (host time on the calling thread, kernel floors, op-by-op forwards, time scale),
the calibration file, and the fit that makes it."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from baton.bench.sim import sim_calibration
from baton.engine.config import EngineConfig
from baton.engine.executor.sim import SimExecutor
from baton.engine.executor.sim_runner import (
    HOST_COEFFICIENTS,
    RunnerCalibration,
    RunnerModel,
    RunnerStep,
    load_calibration,
)
from baton.engine.executor.sim_traces import Trace, TraceBook
from baton.engine.host_speed import measure_host_speed
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import GrammarOutput, NewRequestData, SchedulerOutput
from baton.engine.sim_specs import GPUS, SHAPES

MS = 1e-3


def calibration(**changes: float) -> RunnerCalibration:
    base = RunnerCalibration(
        source="test",
        host_speed_s=0.02,
        host_speed_estimated=False,
        kernel_floor_s=3e-6,
        graph_kernels_per_layer=10.0,
        graph_kernels_fixed=20.0,
        eager_kernels_per_layer=20.0,
        eager_kernels_fixed=40.0,
        sample_kernels=8.0,
        mask_kernels=2.0,
        max_graph_batch=512,
        step_s=1 * MS,
        row_s=0.01 * MS,
        eager_kernel_s=0.02 * MS,
        eager_token_s=0.005 * MS,
        sample_s=0.3 * MS,
        draft_row_s=0.05 * MS,
        draft_step_s=10 * MS,
        mask_s=0.2 * MS,
        mask_row_s=0.01 * MS,
    )
    return dataclasses.replace(base, **changes)


def test_steps_are_graphed_only_when_a_captured_graph_serves_them():
    model = RunnerModel(calibration(max_graph_batch=8), num_layers=30, host_scale=1.0)
    decode = model.step({"a": 1, "b": 1}, {}, logits_rows=2)
    assert decode.graphed and decode.eager_kernels == 0
    prefill = model.step({"a": 7, "b": 1}, {}, logits_rows=1)
    drafted = model.step({"a": 3}, {"a": (5, 6)}, logits_rows=3)
    too_big = model.step({str(i): 1 for i in range(9)}, {}, logits_rows=9)
    for step in (prefill, drafted, too_big):
        assert not step.graphed and step.eager_kernels == 20 * 30 + 40
    assert drafted.draft_rows == 2 and decode.draft_rows == 0
    eager = RunnerModel(calibration(), num_layers=30, host_scale=1.0, enforce_eager=True)
    assert not eager.step({"a": 1}, {}, logits_rows=1).graphed


def test_host_costs_are_the_calibrations_terms_times_the_host_scale():
    c = calibration()
    model = RunnerModel(c, num_layers=2, host_scale=2.0)
    decode = model.step({"a": 1, "b": 1}, {}, logits_rows=2)._replace(mask_rows=2)
    assert model.launch_host_s(decode) == pytest.approx(2 * (c.step_s + 2 * c.row_s))
    expected = c.sample_s + c.mask_s + 2 * c.mask_row_s
    assert model.sample_host_s(decode) == pytest.approx(2 * expected)
    drafted = model.step({"a": 3}, {"a": (5, 6)}, logits_rows=3)
    launch = c.step_s + c.row_s + c.draft_step_s + c.eager_kernel_s * 80 + c.eager_token_s * 3
    assert model.launch_host_s(drafted) == pytest.approx(2 * launch)
    assert model.forward_floor_s(decode) == pytest.approx((10 * 2 + 20) * c.kernel_floor_s)
    assert model.sample_floor_s(0) < model.sample_floor_s(3)
    # The host time is the features' dot product with the fitted coefficients plus sample_s.
    dot = float(np.dot(drafted.features(), c.host_coefficients())) + c.sample_s
    assert dot * 2 == pytest.approx(model.launch_host_s(drafted) + model.sample_host_s(drafted))


def test_a_calibration_round_trips_and_refuses_bad_values(tmp_path):
    c = calibration()
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": c.to_json(), "cells": []}))
    assert load_calibration(path) == c
    with pytest.raises(ValueError, match="row_s"):
        calibration(row_s=-1.0)
    with pytest.raises(ValueError, match="kernel_floor_s"):
        calibration(kernel_floor_s=0.0)
    data = c.to_json()
    del data["mask_s"]
    with pytest.raises(ValueError, match="mask_s"):
        RunnerCalibration.from_json(data)
    path.write_text("[]")
    with pytest.raises(ValueError, match="no 'calibration'"):
        load_calibration(path)


def test_the_shipped_calibration_loads_and_names_what_it_was_fitted_to():
    c = load_calibration()
    assert "gpu_check" in c.source and c.host_speed_s > 0
    assert c.kernel_floor_s < 20e-6  # microseconds, as the GPU profile measured


def _executor(cal: RunnerCalibration, tokenizer, time_scale: float = 1.0) -> SimExecutor:
    prompt = tuple(tokenizer.encode("Tell a story."))
    return SimExecutor(
        GPUS["h200"],
        SHAPES["smollm2-135m"],
        TraceBook([Trace(prompt, (11, 12, 13, 14, 15))]),
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=tokenizer.vocab_size,
        max_num_seqs=4,
        runner=RunnerModel(cal, SHAPES["smollm2-135m"].num_layers, host_scale=1.0),
        time_scale=time_scale,
    )


def _step(sim: SimExecutor, tokenizer, step_id: int, n: int, computed: int) -> SchedulerOutput:
    prompt = tuple(tokenizer.encode("Tell a story."))
    new = NewRequestData(
        request_id="r",
        prompt_token_ids=prompt,
        output_token_ids=(),
        sampling_params=SamplingParams(),
        seed=0,
        block_ids=(),
        num_computed_tokens=computed,
    )
    return SchedulerOutput(
        step_id=step_id,
        new_requests=(new,) if step_id == 1 else (),
        cached_requests=(),
        num_scheduled_tokens={"r": n},
        total_num_scheduled_tokens=n,
        finished_request_ids=frozenset(),
        structured_request_ids=frozenset({"r"}),
    )


def test_the_executor_spends_the_runners_host_time_and_queues_after_it(tokenizer):
    cal = calibration(step_s=4 * MS, eager_kernel_s=0.0, sample_s=3 * MS, mask_s=0.0)
    sim = _executor(cal, tokenizer)
    prompt_len = len(tokenizer.encode("Tell a story."))
    # A prefill runs op by op: its forward starts with the launching and ends after it.
    t0 = time.perf_counter()
    sim.execute_model(_step(sim, tokenizer, 1, prompt_len, 0))
    launched = time.perf_counter()
    assert launched - t0 >= 4 * MS
    forward = sim.device_ops()[-1]
    assert forward.start <= t0 + 1 * MS and forward.end >= t0 + 4 * MS
    words = -(-tokenizer.vocab_size // 32)
    mask = torch.full((4, words), -1, dtype=torch.int32)
    t1 = time.perf_counter()
    out = sim.sample_tokens(1, GrammarOutput(("r",), mask, ())).get_output()
    assert time.perf_counter() - t1 >= 3 * MS and out.sampled_token_ids == [[11]]
    # A decode step replays a graph: its forward is queued once the launch is done.
    t2 = time.perf_counter()
    sim.execute_model(_step(sim, tokenizer, 2, 1, prompt_len))
    forward = sim.device_ops()[-1]
    assert forward.kind == "forward" and forward.start >= t2 + 4 * MS
    sim.sample_tokens(2, None).get_output()
    steps = sim.runner_steps()
    assert [s.graphed for s in steps] == [False, True]
    assert [s.mask_rows for s in steps] == [1, 0]
    assert sim.runner_seconds >= 14 * MS


def test_the_time_scale_stretches_device_time(tokenizer):
    cal = calibration(step_s=0.0, sample_s=0.0, row_s=0.0)
    durations = []
    for scale in (1.0, 3.0):
        sim = _executor(cal, tokenizer, time_scale=scale)
        prompt_len = len(tokenizer.encode("Tell a story."))
        sim.execute_model(_step(sim, tokenizer, 1, prompt_len, 0))
        sim.sample_tokens(1, None).get_output()
        sim.execute_model(_step(sim, tokenizer, 2, 1, prompt_len))
        op = sim.device_ops()[-1]
        durations.append(op.end - op.start)
    assert durations[1] == pytest.approx(3 * durations[0])
    # Kernel floors, not the roofline, set a small model's decode forward.
    assert durations[0] == pytest.approx((10 * 30 + 20 - 8) * cal.kernel_floor_s, rel=0.2)


def test_sim_runner_options_are_validated(tmp_path):
    with pytest.raises(ValueError, match="sim_runner"):
        EngineConfig(device="sim:h200", sim_runner="fast")
    with pytest.raises(ValueError, match="sim_time_scale"):
        EngineConfig(device="sim:h200", sim_time_scale=0)
    with pytest.raises(ValueError, match="need a simulated device"):
        EngineConfig(sim_runner="off")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": calibration().to_json()}))
    assert EngineConfig(device="sim:h200", sim_runner=str(path)).sim_runner == str(path)


def test_host_speed_is_a_positive_time():
    assert 0 < measure_host_speed(repeats=1) < 5.0
    with pytest.raises(ValueError, match="repeats"):
        measure_host_speed(repeats=0)


def test_the_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = calibration()
    steps = []
    for rows in (1, 8, 32, 64, 256):
        for graphed in (True, False):
            for drafts in (0, rows):
                for mask in (0, rows + drafts):
                    kernels = 0.0 if graphed and not drafts else 640.0
                    steps.append(
                        RunnerStep(
                            graphed and not drafts,
                            rows,
                            rows + drafts,
                            rows + drafts,
                            drafts,
                            mask,
                            kernels,
                        )  # fmt: skip
                    )
    coefs = np.array(truth.host_coefficients())
    cells, sim = [], []
    for s in steps:
        engine_ms = float(rng.uniform(0.1, 2.0))
        runner_ms = (float(np.dot(s.features(), coefs)) + truth.sample_s) * 1e3
        cells.append({"step_cpu_ms": engine_ms / 0.5 + runner_ms})
        sim.append({"features": list(s.features()), "step_cpu_ms": engine_ms})
    prof = {"async_free_graphs": {"laps": {"sampler": truth.sample_s * 1e3}}}
    values, _ = sim_calibration.fit(cells, sim, 0.5, prof)
    for name in HOST_COEFFICIENTS:
        if name != "step_s":
            assert values[name] == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-9)
    assert values["step_s"] + values["sample_s"] == pytest.approx(truth.step_s + truth.sample_s)
    assert values["sample_s"] == pytest.approx(truth.sample_s)


def test_nonneg_lstsq_drops_what_would_be_negative():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = np.array([2.0, -1.0, 1.0])
    coef = sim_calibration.nonneg_lstsq(a, y)
    assert coef[1] == 0 and coef[0] == pytest.approx(1.5)


def test_repeated_runs_keep_the_least_disturbed_engine_and_the_median_tpot():
    runs = [
        [{"step_cpu_ms": 3.0, "tpot_ms": 5.0}, {"step_cpu_ms": 1.0, "tpot_ms": 9.0}],
        [{"step_cpu_ms": 2.0, "tpot_ms": 7.0}, {"step_cpu_ms": 4.0, "tpot_ms": 1.0}],
        [{"step_cpu_ms": 5.0, "tpot_ms": 6.0}, {"step_cpu_ms": 6.0, "tpot_ms": 4.0}],
    ]
    assert [r["step_cpu_ms"] for r in sim_calibration.least_engine(runs)] == [2.0, 1.0]
    assert [r["tpot_ms"] for r in sim_calibration.median_tpot(runs)] == [6.0, 4.0]
