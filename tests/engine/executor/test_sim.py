"""The simulated accelerator: its cost model, trace replay, mask check, and the real engine on it
(sync/async parity with preemption and aborts, no device reads outside get_output())."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from engine_testing import run_to_end

from baton.engine import SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig
from baton.engine.executor.sim import SimExecutor
from baton.engine.executor.sim_cost import CostModel, ForwardWork
from baton.engine.executor.sim_traces import Trace, TraceBook
from baton.engine.processing.llm_engine import LLMEngine
from baton.engine.scheduler_output import (
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from baton.engine.sim_specs import GPUS, SHAPES
from baton.engine.sync_check import SyncCheckError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
INSTANCES = [
    {"name": f"person{i}", "age": 20 + i, "tags": [f"t{j}" for j in range(i % 4)]}
    for i in range(12)
]
STORY = (
    "Once upon a time a lighthouse keeper counted the ships that passed, and every night "
    "the lamp turned, slow and bright, over the black water."
)


# ---------------------------------------------------------------- cost model
def test_a_bandwidth_bound_step_twice_the_tokens_costs_the_same():
    model = CostModel(GPUS["h200"], SHAPES["llama-3.1-8b"])
    one = model.forward([ForwardWork(1, 100)] * 8, num_sampled=8)
    two = model.forward([ForwardWork(1, 100)] * 16, num_sampled=16)
    assert one.memory_bound and two.memory_bound
    assert two.seconds == pytest.approx(one.seconds, rel=0.01)
    # A decode step reads the weights once: about 15 GB over 4.8 TB/s.
    assert 3.0e-3 < one.seconds < 3.4e-3


def test_a_compute_bound_step_twice_the_tokens_costs_twice():
    model = CostModel(GPUS["h200"], SHAPES["llama-3.1-8b"])
    one = model.forward([ForwardWork(1024, 0)] * 8, num_sampled=8)
    two = model.forward([ForwardWork(1024, 0)] * 16, num_sampled=16)
    assert not one.memory_bound and not two.memory_bound
    assert two.seconds == pytest.approx(2 * one.seconds, rel=0.01)


def test_slower_gpus_take_longer_and_kv_reads_count():
    shape = SHAPES["llama-3.1-8b"]
    work = [ForwardWork(1, 2000)] * 64
    h200, l4 = CostModel(GPUS["h200"], shape), CostModel(GPUS["l4"], shape)
    assert l4.forward(work, 64).seconds > 10 * h200.forward(work, 64).seconds
    short = h200.forward([ForwardWork(1, 10)] * 64, 64).seconds
    assert h200.forward(work, 64).seconds > short * 1.5  # 64 x 2000 tokens of KV: ~17 GB


# ------------------------------------------------------------------- engine
def _traces(tokenizer, path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts for JSON requests and for free ones, with their traces written to ``path``."""
    json_prompts, free_prompts, traces = [], [], []
    for i, inst in enumerate(INSTANCES):
        prompt = tokenizer.encode(f"Person {i} as JSON:")
        text = json.dumps(inst, separators=(",", ":"))
        traces.append(Trace(tuple(prompt), tuple(tokenizer.encode(text, add_special_tokens=False))))
        json_prompts.append(prompt)
        prompt = tokenizer.encode(f"Story number {i}:")
        story = tokenizer.encode(STORY, add_special_tokens=False)[: 10 + 2 * i]
        traces.append(Trace(tuple(prompt), tuple(story)))
        free_prompts.append(prompt)
    TraceBook(traces).save(path)
    return json_prompts, free_prompts


def _engine(tiny_model_dir: Path, traces: Path, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            device="sim:h200",
            sim_shape="llama-3.1-8b",
            sim_traces=str(traces),
            **kw,
        )
    )


def _json_sp(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 96)
    return SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw
    )


@pytest.fixture(scope="module")
def sim_traces(tokenizer, tmp_path_factory):
    """The module's trace book (see ``_traces``): its path, the JSON prompts, the free ones."""
    path = tmp_path_factory.mktemp("sim_traces") / "t.jsonl"
    return (path, *_traces(tokenizer, path))


@pytest.fixture(scope="module")
def checked_engine(tiny_model_dir, sim_traces):
    """An engine on the simulator (async scheduling, its default there) built with
    BATON_SYNC_CHECK=error: every run on it also checks that the engine thread reads no device
    state outside get_output(). Shared, as a new engine's first compile (its compile workers'
    start) is most of a test's time here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_SYNC_CHECK", "error")
        engine = _engine(tiny_model_dir, sim_traces[0])
    yield engine
    engine.shutdown()


def test_traces_end_requests_where_they_end(checked_engine, tokenizer, sim_traces):
    _, json_prompts, free_prompts = sim_traces
    story = tokenizer.encode(STORY, add_special_tokens=False)
    final = run_to_end(
        checked_engine,
        [
            (free_prompts[3], SamplingParams(max_tokens=200, temperature=0.0)),
            (free_prompts[4], SamplingParams(max_tokens=5, temperature=0.0)),
            (json_prompts[2], _json_sp()),
            (free_prompts[5], SamplingParams(max_tokens=200, ignore_eos=True)),
            (tokenizer.encode("a prompt with no trace"), SamplingParams(max_tokens=4)),
        ],
    )
    assert final["r0"][:2] == ([*story[:16], tokenizer.eos_token_id], "stop")  # trace, EOS
    assert final["r1"][:2] == (story[:5], "length")
    assert json.loads(final["r2"][2]) == INSTANCES[2] and final["r2"][1] == "stop"
    assert "past its trace's end" in final["r3"][3]  # it ignores EOS
    assert "no trace" in final["r4"][3]


@pytest.mark.parametrize("mode", [False, True])
def test_a_token_the_mask_forbids_fails_the_step(tiny_model_dir, tokenizer, tmp_path, mode):
    bad = tokenizer.encode("Not JSON:")
    good = tokenizer.encode("Person 0 as JSON:")
    other = tokenizer.encode("Story number 0:")
    story = tokenizer.encode(STORY * 8, add_special_tokens=False)
    instance = json.dumps(INSTANCES[0], separators=(",", ":"))
    TraceBook(
        [
            Trace(tuple(bad), tuple(tokenizer.encode("hello", add_special_tokens=False))),
            Trace(tuple(good), tuple(tokenizer.encode(instance, add_special_tokens=False))),
            Trace(tuple(other), tuple(story)),
        ]
    ).save(tmp_path / "t.jsonl")
    engine = _engine(tiny_model_dir, tmp_path / "t.jsonl", async_scheduling=mode, max_model_len=512)
    try:
        assert run_to_end(engine, [(good, _json_sp())])["r0"][1] == "stop"  # compiles the schema
        engine.add_request("free", other, SamplingParams(max_tokens=len(story)))
        engine.step()  # the free request is running when the JSON one first samples
        final = run_to_end(engine, [(bad, _json_sp())])
    finally:
        engine.shutdown()
    # The whole step fails: the request whose token the mask forbids and the one beside it.
    assert final["r0"][1] == "error" and final["free"][1] == "error"
    assert "forbidden by the bitmask" in final["r0"][3]


@pytest.fixture(scope="module")
def small_kv_engines(tiny_model_dir, sim_traces):
    """A sync and an async engine on the simulator with KV and token budgets small enough to
    preempt and chunk, and the JSON and free prompts of their traces. Shared by the parity
    runs: a new engine's first compile (its compile workers' start) is most of a run here."""
    traces, json_prompts, free_prompts = sim_traces
    engines = [
        _engine(
            tiny_model_dir,
            traces,
            async_scheduling=mode,
            block_size=4,
            num_kv_blocks=40,
            max_num_batched_tokens=24,
            # Like for like: drafts change how many tokens a step shows before an abort.
            structured_drafts=False,
        )
        for mode in (False, True)
    ]
    yield engines, json_prompts, free_prompts
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("aborts", [False, True])
def test_sync_and_async_give_the_same_outputs_with_preemption(small_kv_engines, aborts):
    engines, json_prompts, free_prompts = small_kv_engines
    requests = []
    for i in range(len(INSTANCES)):
        requests.append((json_prompts[i], _json_sp()))
        requests.append((free_prompts[i], SamplingParams(max_tokens=40, temperature=0.0)))
    abort = {"r3": 4, "r8": 2, "r13": 6} if aborts else None
    results, preemptions = [], []
    for engine in engines:
        sched = engine.core.scheduler
        # Each run starts from an empty prefix cache, whichever ran before on the engine.
        assert sched.kv.reset_prefix_cache()
        before = sched.num_preemptions
        results.append(run_to_end(engine, requests, abort))
        preemptions.append(sched.num_preemptions - before)
    assert results[0] == results[1]
    assert min(preemptions) > 0
    final = results[0]
    assert len(final) == len(requests)
    for i in range(len(INSTANCES)):
        tokens, reason, text, _ = final[f"r{2 * i}"]
        if reason == "abort":
            continue
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(v[1] != "error" for v in final.values())
    if aborts:
        assert final["r3"][1] == "abort" and len(final["r3"][0]) == 4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", ["auto", "ngram"])
def test_drafts_on_the_simulator_keep_every_output(
    small_kv_engines, tiny_model_dir, method, async_scheduling
):
    """Drafts verified against the traces (grammar-forced and prompt-lookup ones, with
    preemption, chunked prefills and max_tokens landing inside drafts) give the outputs the
    engine gives without them, under sync and async scheduling; every kept token passed its
    draft row's mask. Under async scheduling drafts follow a guess of the token in flight."""
    engines, json_prompts, free_prompts = small_kv_engines
    traces = engines[0].config.sim_traces
    requests = []
    for i in range(len(INSTANCES)):
        requests.append((json_prompts[i], _json_sp(max_tokens=96 if i % 3 else 7 + i)))
        requests.append((free_prompts[i], SamplingParams(max_tokens=9 + 3 * i, temperature=0.0)))
    spec = {"method": method, "num_speculative_tokens": 3}
    drafting = _engine(
        tiny_model_dir,
        Path(traces),
        speculative_config=spec,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=24,
        async_scheduling=async_scheduling,
    )
    try:
        assert drafting.config.async_scheduling is async_scheduling
        assert engines[0].core.scheduler.kv.reset_prefix_cache()
        plain = run_to_end(engines[0], requests)
        drafted = run_to_end(drafting, requests)
        stats = drafting.stats()
        preempted = drafting.core.scheduler.num_preemptions
    finally:
        drafting.shutdown()
    assert drafted == plain
    assert all(v[1] != "error" for v in drafted.values())
    for i in range(0, len(requests), 2):
        tokens, reason, text, _ = drafted[f"r{i}"]
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
    assert stats["spec_accepted_tokens"] > 0 and preempted > 0
    # Async: steps planned past drafts that were then rejected were dropped and rewound.
    assert (stats["spec_wasted_rows"] > 0) is async_scheduling


def test_the_simulator_checks_each_draft_position_against_its_own_row(tokenizer, tmp_path):
    """A request verifying drafts keeps tokens at several positions; each is checked against
    the bitmask row of its position, not the request's first row."""
    prompt = tokenizer.encode("Person 0 as JSON:")
    trace = (11, 12, 13, 14)
    sim = SimExecutor(
        GPUS["h200"],
        SHAPES["llama-3.1-8b"],
        TraceBook([Trace(tuple(prompt), trace)]),
        eos_token_id=tokenizer.eos_token_id,
        vocab_size=tokenizer.vocab_size,
        max_num_seqs=4,
    )

    def step(step_id: int, bitmask: torch.Tensor) -> ModelRunnerOutput:
        rid = f"r{step_id}"  # a new request each step, one token past its prompt
        new = NewRequestData(
            request_id=rid,
            prompt_token_ids=tuple(prompt),
            output_token_ids=(11,),
            sampling_params=SamplingParams(),
            seed=0,
            block_ids=(),
            num_computed_tokens=len(prompt),
        )
        so = SchedulerOutput(
            step_id=step_id,
            new_requests=(new,),
            cached_requests=(),
            num_scheduled_tokens={rid: 4},
            total_num_scheduled_tokens=4,
            finished_request_ids=frozenset(),
            structured_request_ids=frozenset({rid}),
            scheduled_spec_decode_tokens={rid: (12, 13, 99)},  # the third draft is rejected
        )
        sim.execute_model(so)
        return sim.sample_tokens(step_id, GrammarOutput((rid,), bitmask, (4,))).get_output()

    words = -(-tokenizer.vocab_size // 32)
    allow_all = torch.full((4, words), -1, dtype=torch.int32)
    out = step(1, allow_all)
    assert out.sampled_token_ids == [[12, 13, 14]] and not out.errors
    # Token 14 is kept at the third position: forbidding it there (only there) fails the step.
    mask = allow_all.clone()
    mask[2, 14 >> 5] &= ~(1 << (14 & 31))
    out = step(2, mask)
    assert out.sampled_token_ids == [[]] and "forbidden by the bitmask" in out.errors["r2"]
    # Forbidding it at the request's first row instead is no failure: the rows are per position.
    mask = allow_all.clone()
    mask[0, 14 >> 5] &= ~(1 << (14 & 31))
    out = step(3, mask)
    assert out.sampled_token_ids == [[12, 13, 14]] and not out.errors


def test_the_engine_reads_no_device_state_outside_get_output(
    checked_engine, sim_traces, monkeypatch
):
    engine = checked_engine
    assert engine.core.checker.mode == "error"
    _, json_prompts, free_prompts = sim_traces
    requests = [(json_prompts[i], _json_sp()) for i in range(4)]
    requests += [(free_prompts[i], SamplingParams(max_tokens=20, logprobs=None)) for i in range(4)]
    final = run_to_end(engine, requests)
    assert all(v[1] in ("stop", "length") for v in final.values())
    # The check is live on the simulator: a planted read is caught.
    real = engine.core.scheduler.schedule

    def planted():
        import torch

        torch.ones(1).sum().item()
        return real()

    monkeypatch.setattr(engine.core.scheduler, "schedule", planted)
    engine.add_request("x", free_prompts[5], SamplingParams(max_tokens=4))
    with pytest.raises(SyncCheckError, match="planted"):
        engine.step()
    # The engine it failed in goes on: the request is dropped and the next run completes.
    monkeypatch.undo()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert run_to_end(engine, requests[4:5])["r0"][1] in ("stop", "length")


def test_the_device_timeline_runs_in_order_and_waits_are_real(tiny_model_dir, tokenizer, tmp_path):
    json_prompts, free_prompts = _traces(tokenizer, tmp_path / "t.jsonl")
    engine = _engine(tiny_model_dir, tmp_path / "t.jsonl", async_scheduling=True)
    try:
        t0 = time.perf_counter()
        run_to_end(engine, [(p, SamplingParams(max_tokens=30)) for p in free_prompts[:6]])
        wall = time.perf_counter() - t0
        executor = engine.core.executor
        assert isinstance(executor, SimExecutor)
        ops = executor.device_ops()
    finally:
        engine.shutdown()
    assert ops and all(a.end <= b.start + 1e-9 for a, b in zip(ops, ops[1:], strict=False))
    busy = sum(o.end - o.start for o in ops)
    assert wall >= busy  # the engine really waited for the simulated device
    assert [o.kind for o in ops[:4]] == ["forward", "sample", "forward", "sample"]


def test_sim_device_options_are_validated():
    with pytest.raises(ValueError, match="h200"):
        EngineConfig(device="sim:h999")
    with pytest.raises(ValueError, match="sim_shape"):
        EngineConfig(device="sim:h200", sim_shape="gpt-5")
    with pytest.raises(ValueError, match="cannot drive the simulated"):
        EngineConfig(device="sim:h200", executor="mp")
    with pytest.raises(ValueError, match="need a simulated device"):
        EngineConfig(sim_traces="x.jsonl")
    cfg = EngineConfig(device="sim:l4")
    assert cfg.executor == "sim" and cfg.async_scheduling is True


def test_the_engine_freezes_its_startup_heap_until_shutdown(tiny_model_dir, tokenizer, tmp_path):
    # Full collections walked the whole start-up heap on the engine thread (90-139 ms pauses
    # in a batch-256 run); frozen objects are skipped, and shutdown gives them back.
    _traces(tokenizer, tmp_path / "t.jsonl")
    gc.unfreeze()
    engine = _engine(tiny_model_dir, tmp_path / "t.jsonl")
    try:
        assert gc.get_freeze_count() > 10_000  # the model, tokenizer and grammar compilers
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_steps_collect_garbage_at_their_waits_and_leave_collection_on(
    tiny_model_dir, tokenizer, tmp_path
):
    # Automatic collection is held off inside a step and runs where the engine thread waits
    # for the device; between steps the process collects as it always does.
    json_prompts, _ = _traces(tokenizer, tmp_path / "t.jsonl")
    engine = _engine(tiny_model_dir, tmp_path / "t.jsonl")
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # due at every wait
    try:
        final = run_to_end(engine, [(p, _json_sp()) for p in json_prompts])
        assert gc.isenabled()
        stats = engine.stats()
    finally:
        gc.set_threshold(*threshold)
        engine.shutdown()
    assert all(f[1] == "stop" for f in final.values())
    assert stats["gc_s"] > 0
