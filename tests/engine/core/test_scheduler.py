"""Scheduler unit tests driven by fake model-runner outputs (no model)."""

from __future__ import annotations

from baton.engine.config import EngineConfig
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus, StructuredState
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.structured_outputs import StructuredOutputManager
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.grammar.spec import StructuredOutputsParams

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
    max_model_len: int = 128,
    prefix_caching: bool = True,
) -> Scheduler:
    cfg = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=prefix_caching,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, prefix_caching), max_model_len)


def make_request(rid: str, prompt_len: int = 10, first: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request.new(
        rid, list(range(first, first + prompt_len)), SamplingParams(**params), (EOS,), 0
    )


def fake_output(sched: Scheduler, so: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a runner returns: one token for every request that reached its end."""
    ids, toks = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests.get(rid)
        ids.append(rid)
        done = req is not None and req.num_computed_tokens >= req.num_tokens
        toks.append([token] if done else [])
    return ModelRunnerOutput(ids, toks)


def run_step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_output(sched, so, token))


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", prompt_len=10))
    s.add_request(make_request("b", prompt_len=10))
    so, outs = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prompt is chunked
    assert [o.request_id for o in outs] == ["a"]
    so, outs = run_step(s)
    # a decodes one token, b finishes its prompt (4 left) and samples.
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert so.total_num_scheduled_tokens == 5


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_len=3))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert s.num_waiting == 1


def test_finish_reasons_length_eos_stop_token_and_min_tokens():
    s = make_scheduler()
    s.add_request(make_request("len", max_tokens=3))
    s.add_request(make_request("eos", first=200))
    s.add_request(make_request("stop", first=300, stop_token_ids=[9]))
    s.add_request(make_request("min", first=400, min_tokens=2))
    finishes = {}
    tokens = {"len": 5, "eos": EOS, "stop": 9, "min": EOS}
    for _ in range(6):
        so = s.schedule()
        out = ModelRunnerOutput(
            list(so.num_scheduled_tokens), [[tokens[r]] for r in so.num_scheduled_tokens]
        )
        for o in s.update_from_output(so, out):
            if o.finished:
                finishes[o.request_id] = (o.finish_reason, o.stop_reason, s_len(o))
    assert finishes["len"][0] == "length"
    assert finishes["eos"][:2] == ("stop", None)
    assert finishes["stop"][:2] == ("stop", 9)
    # min_tokens=2: the first two EOS tokens are ignored, the third stops.
    assert finishes["min"][0] == "stop"
    assert not s.has_unfinished_requests()
    assert s.kv.num_used_blocks == 0


def s_len(o):
    return len(o.new_token_ids)


def test_preemption_and_resume_by_recompute():
    # 6 usable blocks of 4 tokens; two requests of 8-token prompts need 2 blocks
    # each, then grow until the cache runs out.
    s = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)
    s.add_request(make_request("a", prompt_len=8, max_tokens=12, ignore_eos=True))
    s.add_request(make_request("b", prompt_len=8, first=500, max_tokens=12, ignore_eos=True))
    preempted = False
    finished = set()
    for _ in range(60):
        so, outs = run_step(s)
        if so.preempted_request_ids:
            preempted = True
            assert "b" in so.preempted_request_ids
            assert s.requests["b"].status == RequestStatus.PREEMPTED
            assert s.requests["b"].num_computed_tokens == 0
            assert "b" in so.finished_request_ids  # the runner drops its row
        finished |= {o.request_id for o in outs if o.finished}
        s.kv.check_invariants()
        if not s.has_unfinished_requests():
            break
    assert preempted
    assert finished == {"a", "b"}
    assert s.kv.num_used_blocks == 0


def test_resumed_request_is_sent_with_its_outputs():
    s = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)
    s.add_request(make_request("a", prompt_len=8, max_tokens=12, ignore_eos=True))
    s.add_request(make_request("b", prompt_len=8, first=500, max_tokens=12, ignore_eos=True))
    for _ in range(60):
        so = s.schedule()
        resumed = [n for n in so.new_requests if n.request_id == "b" and n.output_token_ids]
        if resumed:
            assert resumed[0].output_token_ids == tuple(s.requests["b"].output_token_ids)
            assert resumed[0].num_computed_tokens < s.requests["b"].num_tokens
            return
        s.update_from_output(so, fake_output(s, so))
    raise AssertionError("b was never resumed")


def test_abort_frees_blocks_anywhere():
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("run"))
    s.add_request(make_request("wait"))
    run_step(s)
    s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.num_used_blocks == 0
    so = s.schedule()
    assert so.finished_request_ids == {"run", "wait"}


def test_prefix_cache_hit_for_shared_prompt():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("first", prompt_len=13, max_tokens=1))
    run_step(s)
    s.add_request(make_request("second", prompt_len=13, max_tokens=1))
    so, _ = run_step(s)
    # 3 full blocks (12 tokens) are cached; the last token is computed again.
    assert so.num_scheduled_tokens == {"second": 1}
    assert so.new_requests[0].num_computed_tokens == 12


def test_no_prefix_cache_when_disabled():
    s = make_scheduler(prefix_caching=False)
    s.add_request(make_request("first", prompt_len=13, max_tokens=1))
    run_step(s)
    s.add_request(make_request("second", prompt_len=13, max_tokens=1))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"second": 13}


def test_runner_error_fails_only_that_request():
    s = make_scheduler()
    s.add_request(make_request("ok"))
    s.add_request(make_request("bad", first=300))
    so = s.schedule()
    out = ModelRunnerOutput(["ok", "bad"], [[5], [5]], errors={"bad": "boom"})
    outs = {o.request_id: o for o in s.update_from_output(so, out)}
    assert outs["bad"].finish_reason == "error" and outs["bad"].error == "boom"
    assert outs["ok"].finish_reason is None
    assert "ok" in s.requests and "bad" not in s.requests


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=12)
    s.add_request(make_request("r", prompt_len=10, max_tokens=100))
    reasons = []
    for _ in range(5):
        _, outs = run_step(s)
        reasons += [o.finish_reason for o in outs if o.finished]
    assert reasons == ["length"]
    assert not s.has_unfinished_requests()


class _ScriptedMatcher:
    """A grammar that rejects token 13, raises on token 66, and ends with token 5; what it
    took goes into ``taken``."""

    def __init__(self, taken: list[int]) -> None:
        self.taken = taken

    def accept_tokens(self, tokens: tuple[int, ...]) -> bool:
        (token,) = tokens
        if token == 66:
            raise RuntimeError("planted accept failure")
        if token == 13:
            return False
        self.taken.append(token)
        return True

    def is_terminated(self) -> bool:
        return self.taken[-1:] == [5]


class _Grammars:
    """A stand-in for the structured-output manager, advancing as it does."""

    advance = staticmethod(StructuredOutputManager.advance)


def _structured_run(ahead: bool) -> tuple[list[list[tuple]], dict[str, list[int]]]:
    """Four structured requests and a free one, their tokens of each step scripted; with
    ``ahead`` the grammars take each step's tokens through advance_grammars first."""
    taken: dict[str, list[int]] = {}
    sched = make_scheduler()
    sched.structured = _Grammars()  # type: ignore[assignment]
    script = {"ok": [7, 8, 9], "ends": [7, 5], "rejects": [7, 13], "raises": [66], "free": [13]}
    for rid in script:
        req = make_request(rid, first=100 + 10 * len(rid))
        sched.add_request(req)
        if rid != "free":
            req.structured = StructuredState(spec=StructuredOutputsParams(regex="x"))
            req.structured.matcher = _ScriptedMatcher(taken.setdefault(rid, []))  # type: ignore[assignment]
    steps = []
    for i in range(4):
        so = sched.schedule()
        ids = [rid for rid in so.num_scheduled_tokens if rid in sched.requests]
        toks = [[script[rid][min(i, len(script[rid]) - 1)]] for rid in ids]
        out = ModelRunnerOutput(ids, toks)
        verdicts = sched.advance_grammars(so, out) if ahead else None
        got = sched.update_from_output(so, out, verdicts)
        steps.append(
            sorted((o.request_id, tuple(o.new_token_ids), o.finish_reason, o.error) for o in got)
        )
    return steps, {rid: t for rid, t in taken.items() if t}


def test_grammars_advanced_ahead_of_the_update_give_the_same_outputs():
    """advance_grammars (the engine's path when it fills the next bitmask beside the update)
    then update_from_output: the same outputs, finishes and grammar states as the update
    alone, for accepted, ending, rejected and raising tokens."""
    ahead, taken_ahead = _structured_run(True)
    plain, taken_plain = _structured_run(False)
    assert ahead == plain and taken_ahead == taken_plain
    finals = {rid: (reason, err) for step in plain for rid, _, reason, err in step if reason}
    assert finals["ends"] == ("stop", None)
    assert finals["rejects"][0] == "error" and "rejected sampled token 13" in finals["rejects"][1]
    assert finals["raises"][0] == "error" and "planted accept failure" in finals["raises"][1]
    assert "ok" not in finals and "free" not in finals
