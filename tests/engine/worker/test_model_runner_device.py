"""The model runner's device path: CPU mirrors against the device state, no host reads of device
values in the runner, the staging helpers, the device setting of the config, and (with CUDA)
the CUDA engine against the CPU one."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from baton.engine import SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig, check_device
from baton.engine.core.async_scheduler import AsyncScheduler
from baton.engine.core.engine_core import EngineCore
from baton.engine.executor.uni import UniExecutor
from baton.engine.models.attention import AttentionMetadata
from baton.engine.processing.llm_engine import LLMEngine
from baton.engine.scheduler_output import SchedulerOutput
from baton.engine.sync_check import SyncChecker, SyncCheckError
from baton.engine.worker import model_runner as mr
from baton.engine.worker.device_buffers import DeviceIO, HostCopy
from baton.engine.worker.request_states import RequestStates
from baton.engine.worker.runner_values import ForwardOutput
from baton.sampler.metadata import SamplingMetadata

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = ["The capital of France is", "def quicksort(arr):", "Once upon a time", "1, 2, 3, 4,"]


def _requests(with_json: bool = True) -> list[tuple[str, SamplingParams]]:
    """Greedy, seeded, penalised, min_tokens, logprobs, logit_bias and (optionally) JSON
    requests (with a bias too)."""
    so = StructuredOutputsParams
    bias = {5: 4.0, 17: -3.0, 1000: 2.5}
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=1.0, seed=7, top_k=20, top_p=0.9),
        SamplingParams(
            max_tokens=14, temperature=0.8, seed=3, repetition_penalty=1.3, logit_bias=bias
        ),
        SamplingParams(max_tokens=10, min_tokens=6, temperature=1.0, seed=9, logprobs=2),
    ]
    if with_json:
        params.append(
            SamplingParams(
                max_tokens=40,
                temperature=0.0,
                structured_outputs=so(json=SCHEMA),
                logit_bias={**bias, 90: 100.0},
            )
        )
    prompts = PROMPTS + ["A JSON person:"]
    return list(zip(prompts, params, strict=False))


def _run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> dict[str, Any]:
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, sp)
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lp = None if c.logprobs is None else [sorted(d) for d in c.logprobs]
                final[out.request_id] = (c.token_ids, c.finish_reason, c.text, lp)
    return final


def _engine(tiny_model_dir: Any, **kw: Any) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("executor", "uni")
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))


# ------------------------------------------------------------------ mirrors
def assert_mirrors_match(states: RequestStates) -> None:
    """Every live row's host length equals the device's, and its last token is in place."""
    rows = sorted(states.row_of.values())
    device_lengths = states.num_tokens_device[rows]
    assert states.num_tokens[rows].tolist() == device_lengths.tolist()
    last = states.token_ids[rows, device_lengths - 1]
    assert last.tolist() == states.last_sampled[rows].tolist()


class _CheckingExecutor(UniExecutor):
    """A CPU ``UniExecutor`` that claims async support (its calls just finish early) and checks
    the mirrors against the device state and the scheduler around every runner call."""

    scheduler: AsyncScheduler | None = None
    checks = 0

    def supports_async_scheduling(self) -> bool:
        return True

    def execute_model(self, so: SchedulerOutput) -> None:
        super().execute_model(so)
        states = self.runner.states
        assert_mirrors_match(states)
        assert self.scheduler is not None
        for rid, row in states.row_of.items():
            req = self.scheduler.requests.get(rid)
            if req is not None and rid in so.num_scheduled_tokens:
                assert states.num_computed[row] == req.num_computed_tokens
                assert states.num_prompt_tokens[row] == len(req.prompt_token_ids)
        self.checks += 1

    def sample_tokens(self, step_id: int, grammar: Any) -> Any:
        out = super().sample_tokens(step_id, grammar)
        assert_mirrors_match(self.runner.states)
        return out


@pytest.mark.slow
def test_mirrors_follow_the_device_through_preemption_under_async_scheduling(tiny_model_dir):
    small = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16}
    reqs = _requests() * 2
    engine = _engine(tiny_model_dir, async_scheduling=False, **small)
    # The reference: the same engine's synchronous run (a second engine would compile the
    # grammar again, in compile workers of its own).
    expected = _run(engine, reqs)
    sync_core = engine.core
    assert sync_core.scheduler.kv.reset_prefix_cache()  # the async run starts cold too
    executor = _CheckingExecutor(sync_core.executor.runner)
    scheduler = AsyncScheduler(
        engine.config, sync_core.scheduler.kv, engine.max_model_len, engine.structured
    )
    executor.scheduler = scheduler
    engine.core = EngineCore(scheduler, executor, async_scheduling=True)
    got = _run(engine, reqs)
    engine.shutdown()
    assert scheduler.num_preemptions > 0
    assert executor.checks > 20
    assert got == expected


# ------------------------------------------------------------ no host reads
def _allow_the_sampler(
    runner: mr.ModelRunner, checker: SyncChecker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lets the sampler and the CPU-only value checks of its inputs read values (on CUDA they
    do not); everything else the runner does stays checked."""

    def allowed(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with checker.allow():
                return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(runner, "sampler", allowed(runner.sampler))
    monkeypatch.setattr(mr, "apply_token_bitmask_", allowed(mr.apply_token_bitmask_))
    monkeypatch.setattr(SamplingMetadata, "_check_values", allowed(SamplingMetadata._check_values))


class _GuardedExecutor(UniExecutor):
    """Runs the runner's calls under the engine's guard, as on CUDA, instead of in allow()."""

    def _device_work(self) -> Any:
        return contextlib.nullcontext()


@pytest.mark.slow
def test_the_runner_reads_no_tensor_value_on_the_host(tiny_model_dir, monkeypatch):
    """On the CPU the sync checker flags reads of any tensor: with the runner outside allow(),
    a whole run (prefill chunks, penalties, min_tokens, logprobs, logit_bias, grammar) reports
    nothing."""
    engine = _engine(tiny_model_dir, async_scheduling=False, max_num_batched_tokens=16)
    checker = SyncChecker("error")
    runner = engine.core.executor.runner
    engine.core.executor = _GuardedExecutor(runner, checker)
    engine.core.checker = checker
    _allow_the_sampler(runner, checker, monkeypatch)
    try:
        got = _run(engine, _requests())
    finally:
        engine.shutdown()
    assert checker.violations == 0
    assert len(got) == 5 and all(v[1] in ("stop", "length") for v in got.values())
    if got["r4"][1] == "stop":
        jsonschema.validate(json.loads(got["r4"][2]), SCHEMA)


def test_the_guard_catches_a_read_in_the_runner(tiny_model_dir):
    """The test above can fail: a planted read in the runner's planning is reported."""
    engine = _engine(tiny_model_dir, async_scheduling=False)
    checker = SyncChecker("error")
    runner = engine.core.executor.runner
    engine.core.executor = _GuardedExecutor(runner, checker)
    engine.core.checker = checker
    real = runner._plan

    def planted(so: SchedulerOutput) -> Any:
        runner.states.num_tokens_device.sum().item()
        return real(so)

    runner._plan = planted
    try:
        engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(SyncCheckError, match="item"):
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: int(t[1]), float])
def test_the_guard_catches_reads_under_inference_mode(read):
    """The runner runs under inference_mode, where ``item`` reaches the checker undecomposed."""
    checker = SyncChecker("error")
    with checker.guard(), torch.inference_mode(), pytest.raises(SyncCheckError, match="item"):
        read(torch.arange(1, 3) if read is not float else torch.ones(()))


# ------------------------------------------------------------- executor (CPU)
def test_cpu_uni_executor_is_synchronous_and_times_the_device(tiny_model_dir):
    engine = _engine(tiny_model_dir, async_scheduling=False)
    try:
        executor = engine.core.executor
        assert isinstance(executor, UniExecutor)
        assert not executor.supports_async_scheduling()
        assert engine.config.executor == "uni" and not engine.config.async_scheduling
        assert executor.runner.io.is_host and executor.runner.io.stream is None
        got = _run(engine, _requests(with_json=False)[:2])
        assert len(got) == 2
        assert executor.device_seconds > 0
    finally:
        engine.shutdown()


# ----------------------------------------------------------------- grammar
@pytest.mark.parametrize(
    "grammar_ids",
    [("a", "b", "c"), ("c", "a"), ("b",)],
    ids=["every-row-in-order", "reordered-subset", "one-row"],
)
def test_grammar_rows_mask_the_logits_rows_of_their_requests(tiny_model_dir, grammar_ids):
    """Mask row i goes to the logits row of grammar request i, whether the rows line up (no
    gather) or are a reordered subset (gathered)."""
    from baton.engine.scheduler_output import GrammarOutput

    engine = _engine(tiny_model_dir, async_scheduling=False)
    try:
        runner = engine.core.executor.runner
        vocab = 64
        allowed = {"a": 5, "b": 17, "c": 40}
        bitmask = torch.zeros(len(grammar_ids), vocab // 32, dtype=torch.int32)
        for i, rid in enumerate(grammar_ids):
            bitmask[i, allowed[rid] // 32] = 1 << (allowed[rid] % 32)
        rows = np.arange(3, dtype=np.int64)
        fwd = ForwardOutput(
            0, ("a", "b", "c"), ("a", "b", "c"), rows, torch.from_numpy(rows), torch.zeros(3, vocab)
        )
        logits = torch.zeros(3, vocab)
        runner._apply_grammar(logits, fwd, GrammarOutput(tuple(grammar_ids), bitmask))
        for i, rid in enumerate(("a", "b", "c")):
            finite = torch.isfinite(logits[i]).nonzero().flatten().tolist()
            assert finite == ([allowed[rid]] if rid in grammar_ids else list(range(vocab)))
    finally:
        engine.shutdown()


# ----------------------------------------------------------------- staging
def test_cpu_staging_is_free_views_and_waits_for_nothing():
    io = DeviceIO.for_device("cpu")
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.arange(4, dtype=np.int64)
    ta, tb = io.to_device([a, b])
    assert ta.data_ptr() == a.ctypes.data and tb.data_ptr() == b.ctypes.data
    assert ta.shape == (2, 3)
    t = torch.arange(3)
    copy = io.to_host([t])
    assert copy.done is None and copy.wait()[0] is t
    assert isinstance(io.mark(), float)
    with io.on_stream():
        pass


def test_host_copy_without_event_returns_its_tensors():
    t = torch.ones(2)
    assert HostCopy((t,)).wait() == (t,)


def test_attention_metadata_takes_numpy_or_cpu_tensors_alike():
    q = np.array([3, 1], dtype=np.int64)
    s = np.array([5, 9], dtype=np.int64)
    tables = np.array([[4, 2, 7], [1, 3, 5]], dtype=np.int64)
    from_numpy = AttentionMetadata.build(q, s, tables, 4)
    from_torch = AttentionMetadata.build(
        torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(tables), 4, "cpu"
    )
    for name in ("slot_mapping", "kv_index", "query_index", "mask", "seq_lens", "block_tables"):
        assert torch.equal(getattr(from_numpy, name), getattr(from_torch, name)), name
    # Token 2 of sequence 0 sits at position 4: block 1 of its table (2), offset 0.
    assert from_numpy.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 2 * 4 + 0, 5 * 4 + 0]
    assert from_numpy.block_tables.tolist() == [[4, 2, 7], [1, 3, 5]]
    assert from_numpy.kv_index.device.type == "cpu"


def test_attention_metadata_refuses_device_tensors_and_empty_batches():
    with pytest.raises(ValueError, match="on the CPU"):
        AttentionMetadata.build(
            torch.ones(1, dtype=torch.int64, device="meta"),
            torch.ones(1, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64),
            4,
        )
    with pytest.raises(ValueError, match="at least one sequence"):
        AttentionMetadata.build(np.zeros(0), np.zeros(0), np.zeros((0, 1)), 4)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda0", "", 0, None])
def test_config_refuses_unknown_device_names(device):
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_config_refuses_cuda_when_it_is_not_available(device):
    with pytest.raises(ValueError, match="CUDA, which is not available"):
        EngineConfig(device=device)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend one CUDA device exists, for the config's resolution rules (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_config_on_cuda_uses_the_uni_executor_with_async_scheduling(fake_cuda):
    for kw in ({}, {"executor": "uni"}, {"async_scheduling": True}):
        cfg = EngineConfig(device="cuda", **kw)
        assert cfg.executor == "uni" and cfg.async_scheduling is True, kw
    cfg = EngineConfig(device="cuda:0", async_scheduling=False)
    assert cfg.executor == "uni" and cfg.async_scheduling is False
    assert EngineConfig(device="cuda", max_concurrent_batches=1).async_scheduling is False
    assert check_device("cuda:0") == torch.device("cuda", 0)


def test_config_refuses_the_mp_executor_and_missing_devices_on_cuda(fake_cuda):
    with pytest.raises(ValueError, match="executor='mp'.*uni"):
        EngineConfig(device="cuda", executor="mp")
    with pytest.raises(ValueError, match="does not exist: this machine has 1"):
        EngineConfig(device="cuda:1")


def test_config_on_cpu_is_unchanged():
    assert EngineConfig(executor="uni").async_scheduling is False
    assert EngineConfig(async_scheduling=False).executor == "uni"
    assert EngineConfig(async_scheduling=True).executor == "mp"


# --------------------------------------------------------------------- GPU
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@pytest.mark.slow
@_needs_cuda
def test_cuda_engine_matches_the_cpu_engine_with_sync_check_on(tiny_model_dir, monkeypatch):
    """Greedy free and JSON requests, async scheduling on CUDA under BATON_SYNC_CHECK=error:
    the same tokens as the CPU engine, and no wait outside get_output()."""
    so = StructuredOutputsParams
    reqs = [
        (p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in PROMPTS
    ] + [
        (
            "A JSON person:",
            SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so(json=SCHEMA)),
        ),
        (
            "Another person:",
            SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so(json=SCHEMA)),
        ),
    ]
    cpu = _engine(tiny_model_dir, async_scheduling=False)
    expected = _run(cpu, reqs)
    cpu.shutdown()
    monkeypatch.setenv("BATON_SYNC_CHECK", "error")
    engine = _engine(tiny_model_dir, device="cuda")
    try:
        assert engine.config.async_scheduling and engine.core.executor.supports_async_scheduling()
        got = _run(engine, reqs)
        assert engine.core.checker.violations == 0
        assert engine.core.executor.device_seconds > 0
        assert engine.stats()["deferred_steps"] > 0
    finally:
        engine.shutdown()
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()}
    for rid in ("r4", "r5"):
        if got[rid][1] == "stop":
            jsonschema.validate(json.loads(got[rid][2]), SCHEMA)


@pytest.mark.gpu
@_needs_cuda
def test_cuda_results_come_back_through_pinned_memory(tiny_model_dir):
    engine = _engine(tiny_model_dir, device="cuda")
    try:
        runner = engine.core.executor.runner
        assert runner.io.stream is not None and runner.io.copy_stream is not None
        seen: list[Any] = []
        real = runner.sample

        def spy(fwd: Any, grammar: Any = None) -> Any:
            s = real(fwd, grammar)
            seen.append(s)
            return s

        runner.sample = spy
        _run(engine, [(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1))])
        sampled = [s for s in seen if s.sample_request_ids]
        assert sampled and all(isinstance(s.host.done, torch.cuda.Event) for s in sampled)
        assert all(t.is_pinned() for s in sampled for t in s.host.tensors)
        assert len(sampled[0].host.tensors) == 4  # tokens, then the three logprob tensors
        assert runner.states.token_ids.is_cuda and runner.kv_caches[0][0].is_cuda
    finally:
        engine.shutdown()


@pytest.mark.gpu
@_needs_cuda
def test_prompt_steps_on_cuda_attend_without_cudnn(tiny_model_dir):
    """cuDNN's attention plans each new key length anew (about 1 ms a layer on an H200): the
    prompt step's SDPA must take another backend."""
    engine = _engine(tiny_model_dir, device="cuda")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(engine, [(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.0))])
    finally:
        engine.shutdown()
    names = {e.key for e in prof.key_averages()}
    assert any("scaled_dot_product" in n for n in names), sorted(names)[:40]
    assert not any("cudnn_attention" in n for n in names)


@pytest.mark.gpu
@pytest.mark.slow
@_needs_cuda
def test_cuda_async_drafts_keep_the_tokens_with_sync_check_on(tiny_model_dir, monkeypatch):
    """Async scheduling with drafts on CUDA under BATON_SYNC_CHECK=error: guessed drafts,
    rows planned past drafts in flight and their rewinds queue no host read, and the tokens
    are those of the same engine without drafts."""
    so = StructuredOutputsParams
    reqs = [
        (p, SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.2)) for p in PROMPTS
    ] + [
        (
            f"A JSON person {i}:",
            SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so(json=SCHEMA)),
        )
        for i in range(3)
    ]
    monkeypatch.setenv("BATON_SYNC_CHECK", "error")
    spec = {"method": "auto", "num_speculative_tokens": 3}
    engine = _engine(tiny_model_dir, device="cuda", speculative_config=spec)
    sched = engine.core.scheduler
    drafter = sched.drafter
    try:
        assert engine.config.async_scheduling
        sched.drafter = None
        expected = _run(engine, reqs)
        sched.drafter = drafter
        got = _run(engine, reqs)
        assert engine.core.checker.violations == 0
        assert sched.num_accepted_tokens > 0
    finally:
        engine.shutdown()
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()}
