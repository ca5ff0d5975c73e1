"""Speculative decoding end to end: outputs equal to the engine without drafts (tiny model,
async scheduling, a worker process, logprobs, penalties, preemption, seeds; a few JSON prompts
on the default model)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from engine_testing import run_to_end

from baton.engine import LLM, SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig
from baton.engine.core.async_scheduler import AsyncScheduler
from baton.engine.core.drafter import Drafter
from baton.engine.core.engine_core import EngineCore
from baton.engine.executor.uni import UniExecutor
from baton.engine.processing.llm_engine import LLMEngine
from baton.engine.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [
    "The capital of France is",
    "A JSON person:",
    "1, 2, 3, 4, 1, 2, 3, 4,",
    "Once upon a time",
    "Pick a word:",
    "Pick one:",
    "the cat the cat the cat",
    "What is 2+2?",
    "A JSON person, seeded:",
]
METHODS = ("grammar", "ngram", "auto")


# ------------------------------------------------------------------ end to end


def _requests(stop_ids: list[int]) -> list[tuple[str, SamplingParams]]:
    so = StructuredOutputsParams
    # A logit_bias on draft positions: each position's row gets its request's bias.
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={28: 6.0, 330: -4.0}),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so(json=SCHEMA)),
        SamplingParams(max_tokens=21, temperature=0.0, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=["e"]),
        SamplingParams(
            max_tokens=20, temperature=0.0, structured_outputs=so(regex=r"(abc|xyz){2,6}")
        ),
        SamplingParams(
            max_tokens=8, temperature=0.0, structured_outputs=so(choice=["red", "green blue"])
        ),
        SamplingParams(max_tokens=17, temperature=0.0, min_tokens=9, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=13, temperature=0.0, logprobs=1),
        SamplingParams(
            max_tokens=40,
            temperature=0.8,
            seed=17,
            structured_outputs=so(json=SCHEMA),
            logit_bias={90: 3.0, 28: 2.0},
        ),
    ]
    return list(zip(PROMPTS, params, strict=True))


def _build(model_dir, spec=None, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(
        EngineConfig(model=str(model_dir), async_scheduling=False, speculative_config=spec, **kw)
    )


def _use(engine: LLMEngine, method: str | None, k: int = 4, structured_only: bool = False) -> None:
    """Switches the engine's drafter (None: no drafts), so that every run shares one engine and
    its compiled grammars (a compile costs seconds on a loaded machine)."""
    spec = SpeculativeConfig(method, k, structured_only=structured_only) if method else None
    engine.core.scheduler.drafter = Drafter(spec, engine.tokenizer) if spec else None


def _stop_ids(engine: LLMEngine) -> list[int]:
    return [engine.tokenizer.encode(w)[0] for w in (" the", ".")]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = _build(tiny_model_dir, {"method": "auto", "num_speculative_tokens": 4})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    _use(engine, None)
    reqs = _requests(_stop_ids(engine))
    return reqs, run_to_end(engine, reqs, abort={"r3": 5})


@pytest.mark.parametrize("method", METHODS)
def test_drafts_change_no_token(engine, reference, method):
    reqs, expected = reference
    _use(engine, method)
    sched = engine.core.scheduler
    drafted, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
    got = run_to_end(engine, reqs, abort={"r3": 5})
    assert got == expected
    assert sched.num_draft_tokens > drafted and sched.num_accepted_tokens > accepted
    assert sched.kv.num_used_blocks == 0
    for rid in ("r1", "r8"):
        if got[rid][1] == "stop":
            jsonschema.validate(json.loads(got[rid][2]), SCHEMA)
    assert got["r5"][2] in ("red", "green blue")


def test_structured_only_drafts_skip_free_text(engine, reference):
    reqs, expected = reference
    _use(engine, "auto", structured_only=True)
    sched = engine.core.scheduler
    free = [i for i, (_, sp) in enumerate(reqs) if sp.structured_outputs is None]
    drafted = sched.num_draft_tokens
    got = run_to_end(engine, [reqs[i] for i in free])
    assert sched.num_draft_tokens == drafted  # free text: no drafts at all
    assert [got[f"r{j}"] for j in range(len(free))] == [expected[f"r{i}"] for i in free]
    got = run_to_end(engine, reqs, abort={"r3": 5})
    assert got == expected and sched.num_draft_tokens > drafted


class _EarlyCpuExecutor(UniExecutor):
    """A CPU ``UniExecutor`` that claims async support (its calls finish before they return,
    which the async loop takes as queued work done early), checking around each forward that
    the runner's rows agree with the scheduler: the same computed tokens for every scheduled
    request, and host lengths equal to the device's wherever no verification is unsettled."""

    scheduler: AsyncScheduler | None = None
    forwards = 0

    def supports_async_scheduling(self) -> bool:
        return True

    def execute_model(self, so):  # noqa: ANN001, ANN201 - the base signature
        super().execute_model(so)
        st, sched = self.runner.states, self.scheduler
        assert sched is not None
        for rid in so.num_scheduled_tokens:
            row = st.row_of[rid]
            assert st.num_computed[row] == sched.requests[rid].num_computed_tokens
        for rid, row in st.row_of.items():
            req = sched.requests.get(rid)
            # A row planned past drafts in flight has an optimistic host length until then.
            settled = req is not None and req.num_output_placeholders <= 1
            if settled and row not in st.unverified:
                assert st.num_tokens[row] == int(st.num_tokens_device[row])
        self.forwards += 1


def _async_core(engine: LLMEngine, method: str | None, k: int = 4) -> tuple[EngineCore, object]:
    """Puts an async core (AsyncScheduler, early CPU executor, the engine's runner and KV
    cache) with the given drafter in the engine; returns it and the core it replaced."""
    old = engine.core
    spec = SpeculativeConfig(method, k) if method else None
    drafter = Drafter(spec, engine.tokenizer) if spec else None
    sched = AsyncScheduler(
        engine.config, old.scheduler.kv, engine.max_model_len, engine.structured, drafter
    )
    executor = _EarlyCpuExecutor(old.executor.runner)
    executor.scheduler = sched
    engine.core = EngineCore(sched, executor, async_scheduling=True)
    return engine.core, old


@pytest.mark.parametrize("method", METHODS)
def test_async_scheduling_with_drafts_changes_no_token(engine, reference, method):
    """Under async scheduling drafts follow a guess of the token in flight, and the step
    planned while they are verified takes the request's next token as if all were kept
    (dropped and rewound when some were not): the outputs stay those of the synchronous engine
    without drafts (greedy, seeded, stop tokens and strings, min_tokens, logprobs, penalties,
    JSON, regex, choice), with drafts proposed and accepted."""
    reqs, _ = reference
    penalised = SamplingParams(
        max_tokens=30, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.4
    )
    reqs = [*reqs, ("the cat the cat the cat", penalised)]
    _use(engine, None)
    aborts = {"r1": 6, "r3": 5}
    expected = run_to_end(engine, reqs, abort=aborts)
    core, old = _async_core(engine, method)
    try:
        got = run_to_end(engine, reqs, abort=aborts)
    finally:
        engine.core = old
    sched = core.scheduler
    # An aborted request shows what it had when it was aborted: with drafts a step may show
    # more tokens at once, so only the prefix relation holds.
    for rid in aborts:
        (a, ra, *_), (b, rb, *_) = got.pop(rid), expected.pop(rid)
        assert ra == rb == "abort" or (ra, a) == (rb, b)
        assert a[: len(b)] == b or b[: len(a)] == a
    assert got == expected
    assert sched.num_draft_tokens > 0
    # The tiny model's prompt lookups rarely continue its guess of the token in flight.
    assert sched.num_accepted_tokens > 0 or method == "ngram"
    assert core.executor.forwards > 20
    # Rows planned past drafts the verification then rejected were dropped and rewound.
    assert sched.num_wasted_rows > 0
    assert sched.kv.num_used_blocks == 0
    if got["r8"][1] == "stop":
        jsonschema.validate(json.loads(got["r8"][2]), SCHEMA)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_in_a_worker_process_change_no_token(tiny_model_dir, reference, async_scheduling):
    """The model worker process (executor "mp") verifies drafts too: its shared bitmask and
    token buffers hold a row per draft position, and its replies say where each request's
    rows lie. Same outputs with and without drafts, in one worker."""
    reqs, _ = reference
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            max_model_len=256,
            executor="mp",
            async_scheduling=async_scheduling,
            speculative_config={"method": "auto", "num_speculative_tokens": 4},
        )
    )
    try:
        assert engine.config.async_scheduling is async_scheduling
        _use(engine, None)
        expected = run_to_end(engine, reqs)
        _use(engine, "auto")
        got = run_to_end(engine, reqs)
        sched = engine.core.scheduler
    finally:
        engine.shutdown()
    assert got == expected
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0
    assert (sched.num_wasted_rows > 0) is async_scheduling  # rewinds reach the worker's rows
    for rid in ("r1", "r8"):
        if got[rid][1] == "stop":
            jsonschema.validate(json.loads(got[rid][2]), SCHEMA)


def _logprob_runs(engine: LLMEngine, reqs: list[tuple[str, SamplingParams]]) -> dict:
    """Each request's final (token ids, logprobs entries), run to the end."""
    for i, (prompt, sp) in enumerate(reqs):
        engine.add_request(f"lp{i}", prompt, sp)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                final[out.request_id] = (list(c.token_ids), c.logprobs)
    return final


def test_logprobs_requests_get_drafts_and_the_same_logprobs(engine):
    so = StructuredOutputsParams
    reqs = [
        (
            "Give JSON:",
            SamplingParams(
                max_tokens=30, temperature=0.0, logprobs=2, structured_outputs=so(json=SCHEMA)
            ),
        ),
        (
            "Pick:",
            SamplingParams(
                max_tokens=20,
                temperature=0.0,
                logprobs=0,
                structured_outputs=so(regex=r"(abc|xyz){2,6}"),
            ),
        ),
        (
            "Sampled:",
            SamplingParams(
                max_tokens=24,
                temperature=0.9,
                seed=5,
                logprobs=1,
                structured_outputs=so(json=SCHEMA),
            ),
        ),
    ]
    _use(engine, None)
    expected = _logprob_runs(engine, reqs)
    _use(engine, "auto")
    sched = engine.core.scheduler
    drafted, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
    got = _logprob_runs(engine, reqs)
    assert sched.num_draft_tokens > drafted and sched.num_accepted_tokens > accepted
    for rid, (tokens, logprobs) in expected.items():
        got_tokens, got_logprobs = got[rid]
        assert got_tokens == tokens
        # One entry per token, each from its own position: the same ids and ranks, and the
        # same values up to float32 summation order (several positions attend at once).
        assert len(got_logprobs) == len(logprobs) == len(tokens)
        for want, have in zip(logprobs, got_logprobs, strict=True):
            assert list(have) == list(want)
            for tid, lp in want.items():
                assert have[tid].rank == lp.rank
                assert have[tid].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_penalised_requests_get_drafts_and_the_same_tokens(tiny_model_dir):
    # float32: in bfloat16 a penalised near-tie may resolve differently with drafts (README).
    engine = _build(
        tiny_model_dir, {"method": "auto", "num_speculative_tokens": 4}, dtype=torch.float32
    )
    so = StructuredOutputsParams
    reqs = [
        (prompt, SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=spec, **pen))
        for prompt in ("one two one two one two one", "a b a b a b a b", "x x x x x x")
        for pen in (
            {"frequency_penalty": 0.5},
            {"repetition_penalty": 2.0},
            {"presence_penalty": 2.0, "frequency_penalty": 0.3},
        )
        for spec in (None, so(json=SCHEMA))
    ]
    reqs.append(
        (
            "Sampled:",
            SamplingParams(
                max_tokens=24,
                temperature=0.9,
                seed=7,
                frequency_penalty=0.5,
                structured_outputs=so(regex=r"(abc|xyz){2,6}"),
            ),
        )
    )
    try:
        _use(engine, None)
        expected = run_to_end(engine, reqs)
        _use(engine, "auto")
        sched = engine.core.scheduler
        got = run_to_end(engine, reqs)
        # Each draft position counts the drafts before it (without that, the frequency
        # penalty rows above come out different: checked).
        assert got == expected
        assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0
    finally:
        engine.shutdown()


def test_drafts_under_preemption_and_small_budgets(tiny_model_dir, reference):
    reqs, expected = reference
    free = [0, 2, 3, 6, 7]  # no grammar: nothing to compile in this second engine
    engine = _build(
        tiny_model_dir,
        {"method": "ngram", "num_speculative_tokens": 5},
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=12,
    )
    got = run_to_end(engine, [reqs[i] for i in free], abort={"r2": 5})
    sched = engine.core.scheduler
    preemptions, accepted = sched.num_preemptions, sched.num_accepted_tokens
    sched.kv.check_invariants()
    # The same under async scheduling, with the runner's rows checked around each forward.
    assert sched.kv.reset_prefix_cache()
    core, _ = _async_core(engine, "ngram", k=5)
    try:
        got_async = run_to_end(engine, [reqs[i] for i in free])
        core.scheduler.kv.check_invariants()
    finally:
        engine.shutdown()
    assert preemptions > 0 and accepted > 0
    assert got == {f"r{j}": expected[f"r{i}"] for j, i in enumerate(free)}
    # Without the abort, r2 (reqs[3]) runs to its end.
    plain = {f"r{j}": expected[f"r{i}"] for j, i in enumerate(free) if i != 3}
    assert {k: v for k, v in got_async.items() if k != "r2"} == plain
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_draft_tokens > 0


def test_default_structured_drafts_under_preemption(tiny_model_dir, reference):
    reqs, expected = reference
    picked = [1, 4, 5, 8, 0]  # JSON, regex, choice, sampled JSON, and free text
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            max_model_len=256,
            block_size=4,
            # 12, not 14: with 14 whether any request was preempted depended on when the
            # grammars finished compiling (seen: 0 or some preemptions, the same drafts).
            num_kv_blocks=12,
            max_num_batched_tokens=16,
        )
    )
    try:
        cfg = engine.config.speculative_config
        if engine.config.async_scheduling or cfg is None:
            pytest.skip("the default engine here schedules asynchronously: no default drafts")
        assert cfg.structured_only
        got = run_to_end(engine, [reqs[i] for i in picked])
        sched = engine.core.scheduler
        assert sched.num_preemptions > 0 and sched.num_accepted_tokens > 0
        sched.kv.check_invariants()
    finally:
        engine.shutdown()
    assert got == {f"r{j}": expected[f"r{i}"] for j, i in enumerate(picked)}
    for j, i in enumerate(picked):
        spec = reqs[i][1].structured_outputs
        if spec is not None and spec.json and got[f"r{j}"][1] == "stop":
            jsonschema.validate(json.loads(got[f"r{j}"][2]), SCHEMA)


def test_seeded_requests_alone_and_in_a_batch_of_16(engine):
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    _use(engine, None)
    want = run_to_end(engine, [("the cat the cat the", sp)])["r0"]
    _use(engine, "auto")
    alone = run_to_end(engine, [("the cat the cat the", sp)])["r0"]
    others = [
        (f"{i} {i} {i} {i}", SamplingParams(max_tokens=16, temperature=1.0, seed=i))
        for i in range(15)
    ]
    batch = run_to_end(engine, [*others, ("the cat the cat the", sp)])["r15"]
    assert alone == want and batch == want


DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "skills"],
    "additionalProperties": False,
}


def test_default_model_json_greedy_equal_with_drafts(default_checkpoint):
    prompts = [
        "<|im_start|>user\nAlice Smith is 31, her email is alice@example.com and she knows "
        "Python and SQL. Give her as JSON.<|im_end|>\n<|im_start|>assistant\n",
    ]
    sp = SamplingParams(
        max_tokens=64,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=DEFAULT_SCHEMA),
    )
    llm = LLM.from_checkpoint(
        default_checkpoint,
        dtype="float32",
        max_model_len=512,
        async_scheduling=False,
        speculative_config={"method": "auto", "num_speculative_tokens": 5},
    )
    results = []
    for method in (None, "auto"):
        _use(llm.engine, method, 5)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        for o in outs:
            assert o.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(o.outputs[0].text), DEFAULT_SCHEMA)
    stats = llm.stats()
    llm.engine.shutdown()
    assert results[0] == results[1]
    assert stats["spec_accepted_tokens"] > 0


def test_async_llm_streams_accepted_tokens_only(tiny_model_dir, engine):
    import asyncio

    from baton.engine.entrypoints.async_llm import AsyncLLM

    prompt = "the cat the cat the cat the cat"
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _use(engine, None)
    want = run_to_end(engine, [(prompt, sp)])["r0"]
    llm = AsyncLLM.from_engine_args(
        str(tiny_model_dir),
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )

    async def stream() -> list:
        return [out async for out in llm.generate(prompt, sp, "s0")]

    try:
        outs = asyncio.run(stream())
        stats = llm.stats()
    finally:
        llm.shutdown()
    counts = [len(o.outputs[0].token_ids) for o in outs]
    final = outs[-1].outputs[0]
    assert (final.token_ids, final.finish_reason, final.text) == want[:3]
    assert counts == sorted(counts) and counts[-1] == 30
    # Fewer outputs than tokens: some steps kept drafts.
    assert len(outs) < 30 and stats["spec_accepted_tokens"] > 0
