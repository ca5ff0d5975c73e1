"""Fault isolation on a real engine (tiny model): a grammar backend that raises for one
request, a compile past its time limit, pathological schemas and KV exhaustion each stay
with the request that caused them; the engine keeps serving everyone else."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from compile_faults import use_faulty_backends

from baton.engine import SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig
from baton.engine.core.request import RequestStatus
from baton.engine.outputs import RequestOutput
from baton.engine.processing.llm_engine import LLMEngine
from baton.grammar.backend import CompiledGrammar, GrammarMatcher
from baton.grammar.compile.dispatcher import WALL_LIMIT_FACTOR
from baton.grammar.spec import StructuredOutputsParams as Spec
from baton.grammar.xgrammar.backend import XGrammarMatcher

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GOOD_REGEX = r"[a-z]{3,8}"
PROMPTS = ("The capital of France is", "Once upon a time", "def f(x):", "1, 2, 3,", "Hi")
# A step with nothing to run idles 2 ms: while the compile workers start (seconds on a busy
# host) steps are cheap, so the bound on draining is a time, not a step count.
DRAIN_LIMIT_S = 120.0
_ids = itertools.count()


def build(tiny_model_dir: Path, **engine_args: Any) -> LLMEngine:
    engine_args.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **engine_args))


def free_params(max_tokens: int = 12, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def structured(max_tokens: int = 24, **spec: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(**spec)
    )


def run(
    engine: LLMEngine,
    requests: Sequence[tuple[str, str, SamplingParams]],
    on_step: Callable[[int, list[RequestOutput]], None] | None = None,
) -> dict[str, RequestOutput]:
    """Adds the requests (id, prompt, params), steps until the engine is idle; the final
    output of each. ``on_step(i, outputs)`` sees every step's outputs."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    final: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + DRAIN_LIMIT_S
    for i in itertools.count():
        if not engine.has_unfinished_requests() or time.monotonic() > deadline:
            break
        outputs = engine.step()
        for out in outputs:
            assert out.request_id not in final, f"{out.request_id} finished twice"
            if out.finished:
                final[out.request_id] = out
        if on_step is not None:
            on_step(i, outputs)
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    assert {rid for rid, _, _ in requests} == set(final)
    return final


def assert_idle(engine: LLMEngine) -> None:
    sched = engine.core.scheduler
    assert not sched.requests and sched.kv.num_used_blocks == 0
    sched.kv.check_invariants()


def assert_normal(out: RequestOutput, sp: SamplingParams) -> None:
    """Finished by stop or length, and a grammar-ended output is a complete instance."""
    for c in out.outputs:
        assert c.finish_reason in ("stop", "length"), (out.request_id, c.finish_reason, c.error)
        assert c.error is None and c.token_ids
        spec = sp.structured_outputs
        if spec is None or c.finish_reason != "stop":
            continue
        if spec.kind == "json":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif spec.kind == "regex":
            assert re.fullmatch(str(spec.regex), c.text), c.text


def new_id(prefix: str) -> str:
    return f"{prefix}{next(_ids)}"


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[str, LLMEngine]]:
    built = {
        "sync": build(tiny_model_dir, async_scheduling=False),
        "async": build(tiny_model_dir, async_scheduling=True),
    }
    yield built
    for engine in built.values():
        engine.shutdown()


# ------------------------------------------------------------- backend raises


class _BrokenFillMatcher(XGrammarMatcher):
    """A matcher whose native mask fill fails, in the batched call and alone."""

    @property
    def xgr_matcher(self) -> Any:
        raise RuntimeError("planted fill failure")

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        raise RuntimeError("planted fill failure")


def sabotage_compile(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, marker: str, where: str
) -> None:
    """Makes the matchers of regex specs starting with ``marker`` raise in ``where``
    ("matcher": creating it, "accept": accepting a token, "fill": filling its mask row);
    every other spec compiles as usual."""
    backend = engine.structured.service.backend("xgrammar")
    real = backend.import_compiled  # the engine's side of a compile (the worker's bytes)

    def import_compiled(spec: Spec, data: bytes) -> CompiledGrammar:
        grammar = real(spec, data)
        if spec.kind != "regex" or not str(spec.regex).startswith(marker):
            return grammar
        make = grammar.new_matcher

        def new_matcher() -> GrammarMatcher:
            if where == "matcher":
                raise RuntimeError("planted matcher failure")
            if where == "fill":
                return _BrokenFillMatcher(grammar.compiled, backend)
            matcher = make()

            def accept_tokens(tokens: Sequence[int]) -> bool:
                raise RuntimeError("planted accept failure")

            matcher.accept_tokens = accept_tokens  # type: ignore[method-assign]
            return matcher

        grammar.new_matcher = new_matcher  # type: ignore[method-assign]
        return grammar

    monkeypatch.setattr(backend, "import_compiled", import_compiled)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["matcher", "accept", "fill"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_raising_grammar_backend_fails_only_its_request(
    engines: dict[str, LLMEngine], monkeypatch: pytest.MonkeyPatch, mode: str, where: str
) -> None:
    engine = engines[mode]
    marker = f"boom{where}{mode}"
    sabotage_compile(engine, monkeypatch, marker, where)
    bad = new_id("bad")
    requests = [
        (new_id("free"), PROMPTS[0], free_params(16, seed=1)),
        (new_id("json"), PROMPTS[1], structured(json=SCHEMA)),
        (bad, PROMPTS[2], structured(regex=marker + "[a-z]{0,20}")),
        # Same backend as the bad one: their masks are filled in the same batched call.
        (new_id("regex"), PROMPTS[3], structured(regex=GOOD_REGEX)),
        (new_id("free"), PROMPTS[4], free_params(16, seed=2)),
    ]
    final = run(engine, requests)
    (failed,) = final[bad].outputs
    assert failed.finish_reason == "error"
    assert failed.error is not None and f"planted {where} failure" in failed.error
    for rid, _, sp in requests:
        if rid != bad:
            assert_normal(final[rid], sp)
    assert_idle(engine)
    # The engine still serves, the broken grammar's spec included once repaired.
    monkeypatch.undo()
    again = [(new_id("after"), PROMPTS[0], structured(regex=GOOD_REGEX))]
    assert_normal(run(engine, again)[again[0][0]], again[0][2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_raising_native_fill_falls_back_to_rows_and_every_request_finishes(
    engines: dict[str, LLMEngine], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The native part of a batched fill (on the fill thread under async) raises: that
    backend's rows of the step are filled one by one instead, and nothing fails."""
    engine = engines[mode]
    backend = engine.structured.service.backend("xgrammar")
    real = backend.plan_fill
    raised: list[int] = []

    def plan_fill(matchers: Any, bitmask: Any, rows: Any, off_thread: bool = False) -> Any:
        real(matchers, bitmask, rows, off_thread)  # the Python side runs, its call is dropped

        def native() -> None:
            raised.append(len(rows))
            raise RuntimeError("planted native fill failure")

        return native

    monkeypatch.setattr(backend, "plan_fill", plan_fill)
    requests = [
        (new_id("json"), PROMPTS[1], structured(json=SCHEMA)),
        (new_id("regex"), PROMPTS[3], structured(regex=GOOD_REGEX)),
        (new_id("free"), PROMPTS[4], free_params(16, seed=2)),
    ]
    final = run(engine, requests)
    for rid, _, sp in requests:
        assert_normal(final[rid], sp)
    assert raised, "no batched xgrammar fill ran"
    if mode == "async":  # deferred steps' fills went through the fill thread
        assert any(t.name == "baton-fill" for t in threading.enumerate())
    assert_idle(engine)


# ------------------------------------------------------------------ slow compile

COMPILE_TIMEOUT_S = 1.0


def endless_schema(n: int) -> dict[str, Any]:
    """outlines builds this pattern's DFA for hours (it doubles with each repetition): a
    compile that never ends and keeps a core busy."""
    return {"type": "string", "pattern": f"^(a|b)*a(a|b){{{n}}}$"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_compile_past_its_time_limit_fails_only_its_request(
    tiny_model_dir: Path, mode: str
) -> None:
    engine = build(
        tiny_model_dir,
        async_scheduling=mode == "async",
        grammar_compile_timeout_s=COMPILE_TIMEOUT_S,
    )
    try:
        # Workers started, the good specs cached: only the endless one compiles below.
        run(engine, [("warm", PROMPTS[0], structured(json=SCHEMA))])
        run(engine, [("warm2", PROMPTS[0], structured(regex=GOOD_REGEX))])
        t0 = time.monotonic()
        failed_after: list[float] = []

        def on_step(_: int, outputs: list[RequestOutput]) -> None:
            failed_after.extend(time.monotonic() - t0 for o in outputs if o.request_id == "slow")

        endless = endless_schema(20 + (mode == "async"))
        requests = [
            ("slow", PROMPTS[0], structured(json=endless, backend="outlines")),
            ("json", PROMPTS[1], structured(json=SCHEMA)),
            ("regex", PROMPTS[2], structured(regex=GOOD_REGEX)),
            *[(f"free{i}", PROMPTS[i], free_params(24, seed=i)) for i in range(3)],
        ]
        final = run(engine, requests, on_step)
        (c,) = final["slow"].outputs
        assert c.finish_reason == "error" and "timed out" in str(c.error)
        # It failed at its limit (a limit on its running time: a busy host stretches it).
        assert failed_after and failed_after[0] < WALL_LIMIT_FACTOR * COMPILE_TIMEOUT_S
        stats = engine.stats()
        assert stats["grammar_compile_timeouts"] == stats["grammar_compile_worker_kills"] == 1
        for rid, _, sp in requests[1:]:
            assert_normal(final[rid], sp)
        assert_idle(engine)
    finally:
        engine.shutdown()


def _free_batch(trial: int) -> list[tuple[str, str, SamplingParams]]:
    return [(f"t{trial}f{i}", PROMPTS[i], free_params(48, seed=i)) for i in range(4)]


def _measure(engine: LLMEngine, trial: int, with_slow: bool) -> tuple[float, int, list[list[int]]]:
    """CPU seconds of the engine's thread per step while four free requests run, the steps
    they took, and their tokens; with a request whose (slow) compile is pending all along
    when ``with_slow``."""
    free = _free_batch(trial)
    free_ids = {rid for rid, _, _ in free}
    done: set[str] = set()
    steps = 0
    if with_slow:
        # A new spec every trial: a cached one would not compile again.
        engine.add_request(f"t{trial}slow", PROMPTS[4], structured(regex=f"sleep{trial}[a-z]"))
    for rid, prompt, sp in free:
        engine.add_request(rid, prompt, sp)
    tokens = {}
    cpu0 = time.thread_time()
    while len(done) < len(free):
        steps += 1
        for out in engine.step():
            if out.finished and out.request_id in free_ids:
                done.add(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    cpu = time.thread_time() - cpu0
    assert len(done) == len(free)
    if with_slow:
        slow = engine.core.scheduler.requests[f"t{trial}slow"]
        assert slow.status == RequestStatus.WAITING_FOR_GRAMMAR  # still compiling
        engine.abort_request(f"t{trial}slow")
    assert not engine.has_unfinished_requests()
    return cpu / steps, steps, [tokens[r] for r, _, _ in free]


@pytest.mark.timeout(240)
def test_a_pending_slow_compile_does_not_slow_the_others(tiny_model_dir: Path) -> None:
    # The compile outlives the whole measurement (no time-out): the free requests run while it
    # is pending. The exact checks: the same steps and tokens with and without it (no step
    # waited for it). The cost check: the engine thread's CPU time per step, in interleaved
    # trials, with the model on that one thread (the in-process executor): thread pools
    # spinning on a loaded host would swing it by 5x.
    engine = build(tiny_model_dir, async_scheduling=False, grammar_compile_timeout_s=60.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        use_faulty_backends(engine)  # "sleep..." regexes wait in their worker, using no CPU
        run(engine, [("warm", PROMPTS[0], structured(regex="warm[a-z]"))])
        base: list[float] = []
        slow: list[float] = []
        for trial in range(5):
            cpu_a, steps_a, tokens_a = _measure(engine, 2 * trial, with_slow=False)
            cpu_b, steps_b, tokens_b = _measure(engine, 2 * trial + 1, with_slow=True)
            assert steps_a == steps_b  # no step waited for the compile
            assert tokens_a == tokens_b
            base.append(cpu_a)
            slow.append(cpu_b)
        # The best trial of each side: the least disturbed by the host, while a cost of the
        # pending compile would be in every trial, the best one included.
        ratio = min(slow) / min(base)
        assert ratio <= 1.5, (ratio, base, slow)
    finally:
        torch.set_num_threads(threads)
        engine.shutdown()


# ------------------------------------------------------------ pathological specs


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


PATHOLOGICAL: dict[str, dict[str, Any]] = {
    "nested_200": {"json": _nested(200)},
    "nested_200_text": {"json": json.dumps(_nested(200))},
    "nested_5000": {"json": _nested(5000)},
    "nested_arrays_5000_text": {"json": "[" * 5000 + "]" * 5000},
    "not_serialisable": {"json": {"type": "object", "default": {1, 2}}},
    "enum_100k": {"json": {"enum": [f"value{i}" for i in range(100_000)]}},
    "max_length_100k": {"json": {"type": "string", "maxLength": 100_000}},
    "min_length_100k": {
        "json": {"type": "object", "properties": {"s": {"type": "string", "minLength": 100_000}}}
    },
    "catastrophic_pattern": {"json": {"type": "string", "pattern": "(a+)+$"}},
    "catastrophic_regex": {"regex": "(a+)+$"},
    "huge_repeat_regex": {"regex": "(a{1000}){1000}"},
}
# Compiles stop at 3 s of running time (CPU time: a few seconds of wall time on a quiet host).
PATHOLOGICAL_LIMIT_S = 3.0
# A bound on submission plus generation that holds under any load: at most two compiles
# ("auto" falls back once after a compile error), each ended by the wall-clock backstop at
# the latest, and 10 s to generate.
PATHOLOGICAL_BOUND_S = 2 * WALL_LIMIT_FACTOR * PATHOLOGICAL_LIMIT_S + 10.0


@pytest.fixture(scope="module")
def guarded_engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    engine = build(
        tiny_model_dir, async_scheduling=False, grammar_compile_timeout_s=PATHOLOGICAL_LIMIT_S
    )
    yield engine
    engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["auto", "outlines"])
@pytest.mark.parametrize("case", list(PATHOLOGICAL))
def test_pathological_specs_are_refused_or_fail_cleanly(
    guarded_engine: LLMEngine, case: str, backend: str
) -> None:
    engine = guarded_engine
    t0 = time.monotonic()
    sp = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(**PATHOLOGICAL[case], backend=backend),
    )
    rid = new_id(case)
    try:
        engine.add_request(rid, PROMPTS[0], sp)
    except ValueError as exc:
        assert str(exc)  # refused at submission, with a message
    else:
        final: RequestOutput | None = None
        while engine.has_unfinished_requests():
            assert time.monotonic() - t0 < PATHOLOGICAL_BOUND_S, f"{case} did not finish"
            for out in engine.step():
                if out.finished:
                    final = out
        assert final is not None
        (c,) = final.outputs
        # Served (a streaming grammar needs no huge table), or failed with a message.
        assert c.finish_reason in ("stop", "length", "error"), c.finish_reason
        assert c.finish_reason != "error" or c.error
    assert time.monotonic() - t0 < PATHOLOGICAL_BOUND_S
    assert_idle(engine)
    after = new_id("after")
    out = run(engine, [(after, PROMPTS[1], free_params(4))])[after]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------ KV exhaustion


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kv_exhaustion_preempts_instead_of_failing(tiny_model_dir: Path, mode: str) -> None:
    # 15 usable blocks of 4 tokens: one request needs up to 8, so a dozen cannot all fit.
    engine = build(
        tiny_model_dir,
        async_scheduling=mode == "async",
        block_size=4,
        num_kv_blocks=16,
        max_num_seqs=12,
    )
    try:
        requests = [
            (f"kv{i}", PROMPTS[i % len(PROMPTS)], free_params(24, seed=i)) for i in range(10)
        ] + [
            ("kvjson", PROMPTS[1], structured(json=SCHEMA)),
            ("kvregex", PROMPTS[2], structured(regex=GOOD_REGEX)),
        ]
        final = run(engine, requests)
        for rid, _, sp in requests:
            assert_normal(final[rid], sp)
            if sp.structured_outputs is None:
                assert len(final[rid].outputs[0].token_ids) == 24
        assert engine.core.scheduler.num_preemptions > 0
        assert_idle(engine)
    finally:
        engine.shutdown()


# --------------------------------------------------------------------- bad input


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e-46),
        ("temperature", 1e-40),
        ("top_p", 1e-46),
        ("repetition_penalty", 1e-46),
    ],
)
def test_values_that_vanish_in_float32_are_refused(
    engines: dict[str, LLMEngine], field: str, value: float
) -> None:
    # Found by the HTTP fuzz: temperature 1e-46 became 0 in the sampler's float32 state
    # while the request counted as random, and the sampler's check failed the whole step.
    engine = engines["sync"]
    params = SamplingParams(max_tokens=4, seed=1, **{"temperature": 1.0, field: value})
    with pytest.raises(ValueError, match=field):
        engine.add_request(new_id("tiny"), PROMPTS[0], params)
    assert not engine.has_unfinished_requests()
    ok = new_id("ok")
    assert_normal(run(engine, [(ok, PROMPTS[0], free_params(4))])[ok], free_params(4))


@pytest.mark.timeout(60)
def test_a_prompt_with_a_lone_surrogate_is_refused(engines: dict[str, LLMEngine]) -> None:
    # Found by the HTTP fuzz: JSON's "\ud800" reached the tokenizer, which raised TypeError.
    engine = engines["sync"]
    with pytest.raises(ValueError, match="Unicode"):
        engine.add_request(new_id("surrogate"), "abc\ud800", free_params(4))
    assert not engine.has_unfinished_requests()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_grammar_that_ends_before_min_tokens_ends_the_output(
    engines: dict[str, LLMEngine], mode: str
) -> None:
    sp = SamplingParams(
        max_tokens=8,
        min_tokens=3,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["a"]),
    )
    rid = new_id("short")
    (c,) = run(engines[mode], [(rid, PROMPTS[0], sp)])[rid].outputs
    assert (c.finish_reason, c.text, c.error) == ("stop", "a", None)


@pytest.mark.timeout(240)
def test_a_panicking_or_crashing_compile_fails_its_requests_and_leaves_the_pool_usable(
    tiny_model_dir: Path,
) -> None:
    # A long limit: requests stuck behind a broken cache entry would wait all of it.
    engine = build(tiny_model_dir, async_scheduling=False, grammar_compile_timeout_s=30.0)
    try:
        use_faulty_backends(engine)  # its workers started: not in the timing below
        t0 = time.monotonic()
        failed_after: dict[str, float] = {}

        def on_step(_: int, outputs: list[RequestOutput]) -> None:
            for o in outputs:
                if o.finished and o.outputs[0].finish_reason == "error":
                    failed_after[o.request_id] = time.monotonic() - t0

        # Same spec three times (one compile serves them), no outlines fallback.
        panicking = structured(regex="panic[a-z]", backend="xgrammar")
        crashing = structured(regex="crash[a-z]", backend="xgrammar")
        requests = [(f"p{i}", PROMPTS[i], panicking) for i in range(3)]
        requests += [
            ("crash", PROMPTS[4], crashing),
            ("ok", PROMPTS[3], structured(regex=GOOD_REGEX)),
        ]
        final = run(engine, requests, on_step)
        for rid, _, _ in requests[:3]:
            (c,) = final[rid].outputs
            assert c.finish_reason == "error" and "planted panic" in str(c.error), c.error
        (c,) = final["crash"].outputs
        assert c.finish_reason == "error" and "worker ended" in str(c.error), c.error
        assert_normal(final["ok"], requests[-1][2])
        # Failed at once, not at the compile time limit (30 s).
        assert set(failed_after) == {"p0", "p1", "p2", "crash"}
        assert max(failed_after.values()) < 15.0, failed_after
        after = [("after", PROMPTS[0], structured(json=SCHEMA))]
        assert_normal(run(engine, after)["after"], after[0][2])
        assert engine.stats()["grammar_compile_worker_deaths"] == 1
    finally:
        engine.shutdown()
