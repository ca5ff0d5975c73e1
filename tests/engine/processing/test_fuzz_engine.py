"""Scheduler and engine fuzz: hypothesis drives a real LLMEngine (tiny model, tiny KV cache)
with random adds, aborts and steps, under sync and async scheduling (and async with drafts
for every request), and checks the
invariants that must hold whatever the interleaving: placeholders stay in range, every
request ends exactly once, no KV block leaks, outputs respect max_tokens and their grammar."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.engine import SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig
from baton.engine.outputs import RequestOutput
from baton.engine.processing.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}( [0-9]{1,3})?"
CHOICES = ("red", "green", "blue")
# Shared prefixes so that prefix caching (block_size 4) finds hits between requests.
BASE = "The quick brown fox jumps over the lazy dog."
PROMPTS: tuple[str | list[int], ...] = (
    BASE,
    BASE + " Then",
    BASE + " And the cat",
    "Once upon a time",
    "1, 2, 3, 4,",
    [1, 504, 3300, 17, 42],
    [1, 504, 3300, 17, 42, 99, 100, 101, 102],
    "Write a short list of the colours of the rainbow, in order, one per line:",
)
STOPS: tuple[tuple[str, ...], ...] = ((), (), (), ("e",), (" the", "}"), ("a", "0"))
# Sequences never need more than 18 + 20 tokens (10 blocks) of the 23 usable ones, so every
# request can run alone, while a handful at once must preempt each other.
ENGINE_ARGS = {
    "max_model_len": 256,
    "block_size": 4,
    "num_kv_blocks": 24,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
}
DRAFTS = {"method": "auto", "num_speculative_tokens": 3}
# Draining is bounded by wall time, not steps: a step while only a grammar compiles idles for
# 2 ms, and on a loaded machine a compile (in a worker process) can outlast thousands of them.
DRAIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Add:
    kind: str
    prompt: int
    max_tokens: int
    n: int
    stop: int
    seed: int
    greedy: bool
    ignore_eos: bool


@dataclass(frozen=True)
class Abort:
    target: int


@dataclass(frozen=True)
class Step:
    count: int


ADD = st.builds(
    Add,
    kind=st.sampled_from(["free", "free", "json", "regex", "choice"]),
    prompt=st.integers(0, len(PROMPTS) - 1),
    # Long requests are what fills the KV cache, so they get half the weight.
    max_tokens=st.one_of(st.integers(1, 20), st.integers(16, 20)),
    n=st.sampled_from([1, 2, 2]),
    stop=st.integers(0, len(STOPS) - 1),
    seed=st.integers(0, 2**31),
    greedy=st.booleans(),
    ignore_eos=st.booleans(),
)
# Adds outweigh aborts and steps so that several requests overlap and preempt each other.
OPS = st.lists(
    st.one_of(
        ADD, ADD, ADD, st.builds(Abort, st.integers(0, 30)), st.builds(Step, st.integers(1, 8))
    ),
    min_size=3,
    max_size=24,
)

_ids = itertools.count()


def build(tiny_model_dir: Path, **engine_args: object) -> LLMEngine:
    """An engine on the tiny model with ENGINE_ARGS, overridden by ``engine_args``."""
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **{**ENGINE_ARGS, **engine_args}))


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[str, LLMEngine]]:
    built = {
        "sync": build(tiny_model_dir, async_scheduling=False),
        "async": build(tiny_model_dir, async_scheduling=True),
        # Drafts for every request (guessed past the tokens in flight, rows planned past
        # drafts in flight, rewinds) in the worker process.
        "async-drafts": build(tiny_model_dir, async_scheduling=True, speculative_config=DRAFTS),
    }
    yield built
    for engine in built.values():
        engine.shutdown()


def params_for(op: Add) -> SamplingParams:
    spec = None
    if op.kind == "json":
        spec = StructuredOutputsParams(json=SCHEMA)
    elif op.kind == "regex":
        spec = StructuredOutputsParams(regex=REGEX)
    elif op.kind == "choice":
        spec = StructuredOutputsParams(choice=CHOICES)
    return SamplingParams(
        n=op.n,
        max_tokens=op.max_tokens,
        temperature=0.0 if op.greedy else 1.0,
        seed=op.seed,
        stop=STOPS[op.stop],
        ignore_eos=op.ignore_eos,
        structured_outputs=spec,
    )


def check_live(engine: LLMEngine) -> None:
    """Invariants that hold after every step."""
    sched = engine.core.scheduler
    spec = engine.config.speculative_config
    # Two steps in flight at most, each one token and its drafts.
    per_step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    limit = 2 * per_step if engine.core.async_scheduling else 0
    for rid, req in sched.requests.items():
        assert 0 <= req.num_output_placeholders <= limit, (rid, req.num_output_placeholders)
        assert 0 <= req.num_computed_tokens <= req.num_tokens_with_placeholders, rid
        assert not req.is_finished, f"finished request {rid} is still in the scheduler"
    assert len(sched.running) <= engine.config.max_num_seqs
    assert {id(r) for r in sched.running}.isdisjoint(id(r) for r in sched.waiting)
    sched.kv.check_invariants()


def check_output(sp: SamplingParams, out: RequestOutput) -> None:
    """A finished prompt's completions: lengths, finish reasons, grammar."""
    assert out.finished and len(out.outputs) == sp.n
    assert sorted(c.index for c in out.outputs) == list(range(sp.n))
    spec = sp.structured_outputs
    for c in out.outputs:
        assert sp.max_tokens is not None
        assert 1 <= len(c.token_ids) <= sp.max_tokens, (len(c.token_ids), sp.max_tokens)
        assert c.finish_reason in ("stop", "length"), (c.finish_reason, c.error)
        if c.finish_reason == "length":
            assert len(c.token_ids) == sp.max_tokens
        if spec is None or c.finish_reason != "stop" or isinstance(c.stop_reason, str):
            continue
        # The grammar ended it: the text is a complete instance.
        if spec.kind == "json":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif spec.kind == "regex":
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES, c.text


def drive(engine: LLMEngine, ops: list[Add | Abort | Step]) -> None:
    """Runs ``ops`` then drains the engine, checking the invariants on the way."""
    added: list[tuple[str, SamplingParams]] = []
    finished: dict[str, RequestOutput] = {}
    aborted: set[str] = set()

    def step() -> None:
        for out in engine.step():
            rid = out.request_id
            assert rid not in aborted, f"output for aborted request {rid}"
            assert rid not in finished, f"second output for finished request {rid}"
            if out.finished:
                finished[rid] = out
        check_live(engine)

    for op in ops:
        if isinstance(op, Add):
            rid = f"f{next(_ids)}"
            sp = params_for(op)
            engine.add_request(rid, PROMPTS[op.prompt], sp)
            added.append((rid, sp))
        elif isinstance(op, Abort):
            if added:
                rid = added[op.target % len(added)][0]
                # Aborting a finished request is allowed and changes nothing.
                engine.abort_request(rid)
                if rid not in finished:
                    aborted.add(rid)
        else:
            for _ in range(op.count):
                step()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        step()
    assert not engine.has_unfinished_requests(), "the engine did not drain"

    assert set(finished) | aborted == {rid for rid, _ in added}
    assert not set(finished) & aborted
    for rid, sp in added:
        if rid in finished:
            check_output(sp, finished[rid])
    sched = engine.core.scheduler
    assert not sched.requests and not sched.running and not sched.waiting
    assert not engine.outputs.has_unfinished()
    sched.kv.check_invariants()
    # Nothing is held: every block is free or a prefix-cached block nobody references.
    assert sched.kv.num_used_blocks == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", "async-drafts"])
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=OPS)
def test_random_adds_aborts_and_steps_keep_the_invariants(
    engines: dict[str, LLMEngine], mode: str, ops: list[Add | Abort | Step]
) -> None:
    drive(engines[mode], ops)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", "async-drafts"])
def test_a_crowd_preempts_and_still_drains(engines: dict[str, LLMEngine], mode: str) -> None:
    engine = engines[mode]
    before = engine.core.scheduler.num_preemptions
    ops: list[Add | Abort | Step] = [
        Add(kind, i % len(PROMPTS), 20, 2, 0, i, False, True)
        for i, kind in enumerate(["free", "json", "regex", "choice", "free", "free"])
    ]
    ops += [Step(3), Abort(1), Step(2), Abort(4)]
    drafted = engine.core.scheduler.num_draft_tokens
    drive(engine, ops)
    assert engine.core.scheduler.num_preemptions > before
    if mode == "async-drafts":
        assert engine.core.scheduler.num_draft_tokens > drafted
