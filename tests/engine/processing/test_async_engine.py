"""Async scheduling end to end on a tiny model: parity with sync, deferral, stats, the worker."""

from __future__ import annotations

import gc
import json
import os
import signal

import jsonschema
import pytest
import torch
from engine_testing import run_to_end

from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig
from baton.engine.processing.llm_engine import LLMEngine
from baton.engine.sync_check import SyncCheckError

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Name three colours:",
    "Translate: good morning",
    "import numpy as np",
    "What is 2+2?",
    "A JSON person:",
    "Pick one:",
]


def mixed_requests(stop_ids: list[int]) -> list[tuple[str, SamplingParams]]:
    """Free, JSON, regex and choice requests; greedy and seeded; every stop condition; a
    logit_bias on a free and a JSON request."""
    so = StructuredOutputsParams
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so(json=SCHEMA)),
        SamplingParams(max_tokens=16, temperature=1.0, seed=7, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=["e"]),
        SamplingParams(
            max_tokens=20, temperature=0.8, seed=11, structured_outputs=so(regex=r"[a-z]{3,9}")
        ),
        SamplingParams(
            max_tokens=8,
            temperature=1.0,
            seed=5,
            structured_outputs=so(choice=["red", "green", "blue"]),
        ),
        SamplingParams(
            max_tokens=10, min_tokens=6, temperature=1.0, seed=9, stop_token_ids=stop_ids
        ),
        SamplingParams(
            max_tokens=30,
            temperature=1.0,
            seed=13,
            top_k=20,
            top_p=0.9,
            repetition_penalty=1.2,
            logit_bias={28: 3.0, 330: -2.0},
        ),
        SamplingParams(
            max_tokens=40,
            temperature=0.7,
            seed=17,
            structured_outputs=so(json=SCHEMA),
            logit_bias={90: 3.0},
        ),
        SamplingParams(max_tokens=14, temperature=0.0, logprobs=2),
    ]
    return list(zip(PROMPTS, params, strict=True))


def build(tiny_model_dir, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    # One torch thread in the model worker: with two, on a 2-core machine that also runs the
    # engine thread (and, in the suite, another test process), every parallel op waits for a
    # descheduled thread; the async run took 5-25 s instead of 6-8 s. Tokens do not change.
    kw.setdefault("worker_threads", 1)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """A sync and an async engine; the async one is built with BATON_SYNC_CHECK=error, so every
    run on it also checks that the engine thread reads no device value outside get_output()."""
    sync = build(tiny_model_dir, async_scheduling=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_SYNC_CHECK", "error")
        asy = build(tiny_model_dir, async_scheduling=True)
    yield sync, asy
    sync.shutdown()
    asy.shutdown()


def _stop_ids(engine: LLMEngine) -> list[int]:
    return [engine.tokenizer.encode(w)[0] for w in (" the", " a", ",", ".", " and")]


def test_async_and_sync_give_the_same_tokens(engines):
    sync, asy = engines
    reqs = mixed_requests(_stop_ids(sync))
    a = run_to_end(sync, reqs, abort={"r7": 5})
    b = run_to_end(asy, reqs, abort={"r7": 5})
    assert a == b
    reasons = {v[1] for v in a.values()}
    assert {"stop", "length", "abort"} <= reasons
    assert a["r7"][1] == "abort" and len(a["r7"][0]) == 5
    for rid in ("r1", "r8"):
        if a[rid][1] == "stop":
            jsonschema.validate(json.loads(a[rid][2]), SCHEMA)
    assert a["r5"][2] in ("red", "green", "blue")


def test_async_with_each_fill_on_the_engine_thread_gives_the_same_tokens(engines, tiny_model_dir):
    """grammar_fill_thread=False (each deferred fill after the update, on the engine thread,
    as the bench's comparison runs it) against sync; the default engines use the fill thread."""
    sync, _ = engines
    reqs = mixed_requests(_stop_ids(sync))
    engine = build(tiny_model_dir, async_scheduling=True, grammar_fill_thread=False)
    try:
        assert run_to_end(engine, reqs, abort={"r7": 5}) == run_to_end(sync, reqs, abort={"r7": 5})
        assert engine.stats()["deferred_steps"] > 0
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="grammar_fill_thread must be True or False"):
        EngineConfig(grammar_fill_thread=1)


def test_parity_under_preemption_and_chunked_prefill(tiny_model_dir):
    reqs = mixed_requests([]) * 2
    results = []
    for mode in (False, True):
        engine = build(
            tiny_model_dir,
            async_scheduling=mode,
            block_size=4,
            num_kv_blocks=24,
            max_num_batched_tokens=16,
        )
        results.append(run_to_end(engine, reqs))
        preemptions = engine.core.scheduler.num_preemptions
        engine.shutdown()
        assert preemptions > 0
    assert results[0] == results[1]


def test_deferral_happens_iff_a_structured_token_is_in_flight(engines):
    sync, asy = engines
    free = [(p, SamplingParams(max_tokens=8, temperature=0.0)) for p in PROMPTS[:4]]
    before = asy.stats()["deferred_steps"]
    run_to_end(asy, free)
    assert asy.stats()["deferred_steps"] == before  # free requests never defer
    json_sp = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    steps0 = asy.stats()["steps"]
    run_to_end(asy, [(PROMPTS[0], json_sp)])
    stats = asy.stats()
    # Every decode step of a lone structured request has its previous token in flight.
    assert stats["deferred_steps"] - before == stats["steps"] - steps0 - 1
    sync_before = sync.stats()["deferred_steps"]
    run_to_end(sync, [(PROMPTS[0], json_sp)])
    assert sync.stats()["deferred_steps"] == sync_before == 0


def test_a_stop_is_returned_without_waiting_for_the_wasted_row(engines, monkeypatch):
    """A lone structured request that stops (its grammar ends) in step N comes back before
    the engine waits for the deferred step N+1 queued behind it, whose row is wasted."""
    _, asy = engines
    executor = asy.core.executor
    sampled, waited = [], []
    real_sample = executor.sample_tokens

    def sample_tokens(step_id, grammar):
        output = real_sample(step_id, grammar)
        sampled.append(step_id)
        real_get = output.get_output

        def get_output():
            waited.append(step_id)
            return real_get()

        monkeypatch.setattr(output, "get_output", get_output)
        return output

    monkeypatch.setattr(executor, "sample_tokens", sample_tokens)
    sp = SamplingParams(
        max_tokens=30,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]),
    )
    asy.add_request("stop", PROMPTS[9], sp)
    finished = None
    while finished is None:
        for out in asy.step():
            if out.finished:
                finished = out
    assert finished.outputs[0].finish_reason == "stop"
    assert finished.outputs[0].text in ("red", "green", "blue")
    assert sampled[-1] not in waited  # the wasted row is still in flight
    assert asy.has_unfinished_requests()  # ... and the engine drains it on the next call
    while asy.has_unfinished_requests():
        assert asy.step() == []
    assert waited == sampled


def test_stats_report_every_phase(engines):
    _, asy = engines
    run_to_end(asy, [(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in PROMPTS[:3]])
    stats = asy.stats()
    for key in ("steps", "deferred_steps", "device_busy_fraction", "schedule_s", "bitmask_s"):
        assert key in stats
    assert stats["steps"] > 0
    assert 0.0 < stats["device_busy_fraction"] <= 1.0
    assert stats["device_wait_s"] > 0 and stats["update_s"] > 0 and stats["schedule_s"] > 0


def test_max_tokens_takes_no_extra_step(engines):
    for engine in engines:
        steps = engine.stats()["steps"]
        run_to_end(
            engine, [(PROMPTS[0], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))]
        )
        assert engine.stats()["steps"] - steps == 9


def test_sync_check_catches_a_planted_item(engines, monkeypatch):
    _, engine = engines
    assert engine.core.checker.mode == "error"
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    json_sp = SamplingParams(
        max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    reqs = [(PROMPTS[0], sp), (PROMPTS[1], json_sp)]
    assert len(run_to_end(engine, reqs)) == 2  # the step itself never waits outside get_output()
    real = engine.core.scheduler.schedule

    def planted():
        torch.ones(1).sum().item()
        return real()

    monkeypatch.setattr(engine.core.scheduler, "schedule", planted)
    engine.add_request("x", PROMPTS[2], sp)
    with pytest.raises(SyncCheckError, match="planted"):
        engine.step()
    # The engine it failed in goes on: the request is dropped and the next run completes.
    monkeypatch.undo()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert run_to_end(engine, reqs[:1])["r0"][1] == "length"


def test_worker_crash_fails_requests_instead_of_hanging(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=256, async_scheduling=True)
    engine = llm.engine
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], sp)
    engine.add_request("b", PROMPTS[1], sp)
    engine.step()
    engine.step()
    os.kill(engine.core.executor.worker_pid, signal.SIGKILL)
    final = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert set(final) == {"a", "b"}
    for c in final.values():
        assert c.finish_reason == "error"
    with pytest.raises(RuntimeError, match="worker"):
        llm.generate(["hello"], sp, use_tqdm=False)
    llm.shutdown()


def test_worker_process_dies_with_the_engine(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=128, async_scheduling=True)
    pid = llm.engine.core.executor.worker_pid
    os.kill(pid, 0)  # alive
    del llm
    gc.collect()
    # The finalizer stopped and reaped it: the pid names no process of ours any more.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_large_messages_both_ways_do_not_deadlock(tiny_model_dir):
    # Long prompts make "execute" messages larger than a pipe's buffer, sent while
    # replies with logprobs come back: neither side may block the other.
    engine = build(tiny_model_dir, max_model_len=2048, max_num_seqs=32, async_scheduling=True)
    try:
        prompt = list(range(1000, 2900))
        sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=20, ignore_eos=True)
        final = run_to_end(engine, [(prompt, sp)] * 24)
        assert len(final) == 24 and all(len(v[0]) == 4 for v in final.values())
    finally:
        engine.shutdown()
