"""AsyncScheduler with fake runner outputs: placeholders, deferral, wasted rows, invariants."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.engine.config import EngineConfig
from baton.engine.core.async_scheduler import AsyncScheduler
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64) -> AsyncScheduler:
    cfg = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_kv_blocks=num_blocks,
    )
    return AsyncScheduler(cfg, KVCacheManager(num_blocks, block_size, True), 128)


def make_request(rid: str, prompt_len: int = 6, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request.new(rid, list(range(100, 100 + prompt_len)), SamplingParams(**params), (EOS,), 0)


@dataclass
class FakeDevice:
    """Steps in flight, oldest first, with the requests that sample in each."""

    sched: AsyncScheduler
    in_flight: deque[tuple[SchedulerOutput, list[str]]] = field(default_factory=deque)
    rows: dict[str, int] = field(default_factory=dict)  # request -> rows it was scheduled in

    def schedule(self) -> SchedulerOutput:
        before = {rid: r.num_output_placeholders for rid, r in self.sched.requests.items()}
        so = self.sched.schedule()
        sampling = [
            rid
            for rid in so.num_scheduled_tokens
            if self.sched.requests[rid].num_output_placeholders > before.get(rid, 0)
        ]
        for rid in so.num_scheduled_tokens:
            self.rows[rid] = self.rows.get(rid, 0) + 1
        self.in_flight.append((so, sampling))
        return so

    def deliver(self, token: int | dict[str, int] = 7):
        so, sampling = self.in_flight.popleft()
        tok = (lambda rid: token.get(rid, 7)) if isinstance(token, dict) else (lambda rid: token)
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(ids, [[tok(r)] if r in sampling else [] for r in ids])
        return self.sched.update_from_output(so, out)


def test_placeholders_count_tokens_in_flight():
    s = make_scheduler()
    dev = FakeDevice(s)
    s.add_request(make_request("a"))
    dev.schedule()  # prefill: samples its first token
    req = s.requests["a"]
    assert req.num_output_placeholders == 1
    so2 = dev.schedule()  # planned before token 1 is known: decodes the placeholder
    assert so2.num_scheduled_tokens == {"a": 1}
    assert req.num_output_placeholders == 2
    dev.deliver()
    assert req.num_output_placeholders == 1 and req.output_token_ids == [7]
    dev.deliver()
    assert req.num_output_placeholders == 0 and req.output_token_ids == [7, 7]


def test_prefill_chunk_that_samples_nothing_gets_no_placeholder():
    s = make_scheduler(budget=4)
    dev = FakeDevice(s)
    s.add_request(make_request("a", prompt_len=10))
    dev.schedule()
    assert s.requests["a"].num_output_placeholders == 0
    dev.schedule()
    assert s.requests["a"].num_output_placeholders == 0
    dev.schedule()  # the last 2 prompt tokens: samples
    assert s.requests["a"].num_output_placeholders == 1


def test_max_tokens_costs_no_extra_step():
    s = make_scheduler()
    dev = FakeDevice(s)
    s.add_request(make_request("a", max_tokens=3))
    finished = []
    while s.has_unfinished_requests() or dev.in_flight:
        if len(dev.in_flight) < 2 and s.has_unfinished_requests():
            so = dev.schedule()
            if so.is_empty:
                dev.in_flight.pop()
            if len(dev.in_flight) < 2 and not so.is_empty:
                continue
        finished += [o for o in dev.deliver() if o.finished]
    assert [o.finish_reason for o in finished] == ["length"]
    assert dev.rows["a"] == 3  # prefill + 2 decodes, the same as synchronous scheduling


def test_stop_token_wastes_exactly_one_row():
    s = make_scheduler()
    dev = FakeDevice(s)
    s.add_request(make_request("a", max_tokens=50))
    dev.schedule()
    dev.schedule()
    outs = dev.deliver(EOS)  # the first token is EOS; step 2 already holds a row for it
    assert outs[0].finish_reason == "stop"
    assert dev.deliver() == []  # the wasted row's token is never shown
    assert dev.rows["a"] == 2
    assert not s.has_unfinished_requests()


def test_preemption_zeroes_placeholders_and_drops_the_stale_token():
    # 4 usable blocks of 4 tokens: two 8-token prompts fill them; decoding needs a fifth.
    s = make_scheduler(num_blocks=5, block_size=4)
    dev = FakeDevice(s)
    s.add_request(make_request("a", prompt_len=8))
    s.add_request(make_request("b", prompt_len=8))
    dev.schedule()
    assert s.requests["b"].num_output_placeholders == 1
    dev.schedule()  # both need a third block; only one is free: b is preempted
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    outs = dev.deliver()  # step 1 delivers b's token: stale, dropped
    assert [o.request_id for o in outs] == ["a"]
    assert b.output_token_ids == [] and b.num_output_placeholders == 0


def _structured_request(rid: str) -> Request:
    req = make_request(rid)
    req.structured = object()  # type: ignore[assignment] - only "is not None" is read here
    return req


def test_pending_structured_output_tokens_iff_structured_token_in_flight():
    s = make_scheduler()
    dev = FakeDevice(s)
    s.add_request(make_request("free"))
    so1 = dev.schedule()
    so2 = dev.schedule()
    assert not so1.pending_structured_output_tokens and not so2.pending_structured_output_tokens
    dev.deliver()
    json_req = _structured_request("json")  # added by hand: no grammar to compile
    s.requests[json_req.request_id] = json_req
    s.waiting.append(json_req)
    so3 = dev.schedule()  # json's prefill: no token of it in flight yet
    assert "json" in so3.structured_request_ids
    assert not so3.pending_structured_output_tokens
    dev.deliver()
    so4 = dev.schedule()  # json decodes while its first token is still in flight
    assert so4.pending_structured_output_tokens
    dev.deliver()
    dev.deliver()
    so5 = dev.schedule()  # nothing in flight: the grammar is current
    assert not so5.pending_structured_output_tokens


# ------------------------------------------------------------------ hypothesis
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 6)),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("deliver"), st.sampled_from([7, EOS])),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_placeholder_invariants(ops):
    s = make_scheduler(num_blocks=9, block_size=4, budget=16)
    dev = FakeDevice(s)
    added: list[str] = []
    ended: set[str] = set()
    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            s.add_request(make_request(rid, prompt_len=op[1], max_tokens=op[2]))
            added.append(rid)
        elif op[0] == "schedule" and len(dev.in_flight) < 2 and s.has_unfinished_requests():
            dev.schedule()
        elif op[0] == "deliver" and dev.in_flight:
            ended |= {o.request_id for o in dev.deliver(op[1]) if o.finished}
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)]
            if s.finish_requests([rid], RequestStatus.FINISHED_ABORTED):
                ended.add(rid)
        _check(s, dev, added, ended)
    while dev.in_flight:  # drain: every placeholder is retired
        ended |= {o.request_id for o in dev.deliver() if o.finished}
    for req in s.requests.values():
        assert req.num_output_placeholders == 0
    _check(s, dev, added, ended)


def _check(s: AsyncScheduler, dev: FakeDevice, added: list[str], ended: set[str]) -> None:
    live = set(s.requests)
    assert live | ended == set(added)  # no request lost
    assert not live & ended
    for req in s.requests.values():
        assert 0 <= req.num_output_placeholders <= len(dev.in_flight)
        if req.status == RequestStatus.RUNNING:
            assert req in s.running
            assert req.num_computed_tokens <= req.num_tokens_with_placeholders
        else:
            assert req.num_output_placeholders == 0
            assert req in s.waiting
    s.kv.check_invariants()


def test_engine_config_resolves_async_scheduling(caplog, monkeypatch):
    monkeypatch.setattr("baton.engine.config.num_cpu_cores", lambda: 8)
    assert EngineConfig().async_scheduling is True
    assert EngineConfig().executor == "mp"
    monkeypatch.setattr("baton.engine.config.num_cpu_cores", lambda: 2)
    with caplog.at_level("INFO", logger="baton.engine.config"):
        assert EngineConfig().async_scheduling is False
    assert "only 2 CPU cores" in caplog.text
    assert EngineConfig(async_scheduling=True).executor == "mp"  # slower, but allowed
    caplog.clear()
    with caplog.at_level("INFO", logger="baton.engine.config"):
        cfg = EngineConfig(executor="uni")
    assert cfg.async_scheduling is False
    assert "async scheduling off" in caplog.text
    assert EngineConfig(async_scheduling=False).executor == "uni"
    with pytest.raises(ValueError, match="async_scheduling=True is incompatible"):
        EngineConfig(async_scheduling=True, executor="uni")
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        EngineConfig(max_concurrent_batches=3)
    with pytest.raises(ValueError, match="executor"):
        EngineConfig(executor="thread")


def test_worker_threads_keep_to_the_cores_and_to_omp_num_threads(monkeypatch):
    from baton.engine.processing import model_setup

    monkeypatch.setattr(model_setup, "num_cpu_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert model_setup._worker_threads(EngineConfig(executor="mp")) == 7  # one for the engine
    assert model_setup._worker_threads(EngineConfig(executor="mp", worker_threads=3)) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert model_setup._worker_threads(EngineConfig(executor="mp")) == 2
    assert model_setup._worker_threads(EngineConfig(executor="mp", worker_threads=5)) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert model_setup._worker_threads(EngineConfig(executor="mp")) == 7
    monkeypatch.setattr(model_setup, "num_cpu_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert model_setup._worker_threads(EngineConfig(executor="mp")) == 1


class _ListDrafter:
    """A drafter proposing fixed tokens for every request (``Drafter``'s interface)."""

    def __init__(self, tokens: list[int]) -> None:
        from baton.engine.speculative_config import SpeculativeConfig

        self.config = SpeculativeConfig("ngram", 3)
        self.tokens = tokens

    def can_draft(self, req: Request) -> bool:
        return True

    def propose(self, req: Request, max_drafts: int) -> tuple[int, ...]:
        return tuple(self.tokens[:max_drafts])


def _deliver(s: AsyncScheduler, so: SchedulerOutput, tokens: dict[str, list[int]]) -> None:
    ids = list(so.num_scheduled_tokens)
    s.update_from_output(so, ModelRunnerOutput(ids, [tokens.get(r, []) for r in ids]))


def test_drafts_in_flight_reserve_placeholders_and_a_rejection_rewinds_the_next_step():
    s = make_scheduler()
    s.drafter = _ListDrafter([7, 8, 9, 10, 11])
    s.add_request(make_request("a", max_tokens=30))
    s.add_request(make_request("b", max_tokens=30))
    prefill = s.schedule()
    a = s.requests["a"]
    # Token 1 of each is in flight: the drafts follow a guess of it (the first proposal).
    d1 = s.schedule()
    assert d1.scheduled_spec_decode_tokens == {"a": (8, 9, 10), "b": (8, 9, 10)}
    assert a.num_output_placeholders == 1 + 1 + 3
    _deliver(s, prefill, {"a": [7], "b": [7]})
    # Both have drafts in flight and nothing waits: no step until they are verified.
    assert s.schedule().is_empty
    # a keeps all three and one more, b keeps one: b's count goes back.
    _deliver(s, d1, {"a": [8, 9, 10, 5], "b": [8, 4]})
    assert a.num_output_placeholders == 0 and a.num_computed_tokens == a.num_tokens - 1
    b = s.requests["b"]
    assert b.num_computed_tokens == b.num_tokens - 1 and b.output_token_ids == [7, 8, 4]
    # Now a's drafts in flight sit beside c's prefill: a's next row is planned as if all kept.
    s.add_request(make_request("c"))
    d2 = s.schedule()
    assert d2.scheduled_spec_decode_tokens["a"] == (7, 8, 9)
    opt = s.schedule()
    # Its drafts there follow the guess of all five tokens in flight (three drafts, 8 9 10
    # kept, one more): the proposals past them.
    assert opt.scheduled_spec_decode_tokens["a"] == (11,)
    assert opt.num_scheduled_tokens["a"] == 2
    computed_before = a.num_computed_tokens
    _deliver(s, d2, {"a": [7, 3], "b": [7, 8, 9, 1], "c": [6]})  # a keeps 1 of 3 drafts
    assert a.output_token_ids[-2:] == [7, 3]
    assert a.num_output_placeholders == 0 and a.stale_through_step == opt.step_id
    assert a.num_computed_tokens == computed_before - 2 - 2 == a.num_tokens - 1
    nxt = s.schedule()
    assert nxt.rewound["a"] == (a.num_tokens, 2)
    _deliver(s, opt, {"a": [99], "b": [1], "c": [1]})  # a's token there is stale: dropped
    assert 99 not in a.output_token_ids
    # a's row in opt, then b's and c's in nxt (their drafts in opt were rejected too).
    assert s.num_wasted_rows == 3 and set(s.schedule().rewound) == {"b", "c"}
