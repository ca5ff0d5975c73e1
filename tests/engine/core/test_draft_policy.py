"""The draft policy: how many drafts a step carries, from given step times and verdicts."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engine_testing import run_to_end

from baton.engine import SamplingParams, StructuredOutputsParams
from baton.engine.config import EngineConfig
from baton.engine.core.draft_policy import (
    COST_HORIZON,
    EXPLORE_EVERY,
    EXPLORE_ROWS,
    MAX_EXPLORE_GAP,
    MIN_PROPOSED,
    DraftPolicy,
    decode_rows,
    step_seconds,
)
from baton.engine.processing.llm_engine import LLMEngine
from baton.engine.scheduler_output import NewRequestData, SchedulerOutput
from baton.engine.speculative_config import SpeculativeConfig


def _fed(fixed: float, per_row: float, accept: float, rows: tuple[int, ...] = (4, 8, 12)):
    """A policy that saw steps costing ``fixed + per_row * rows`` and requests whose first
    draft was kept with probability ``accept`` (each later one with the same, given the last).
    """
    policy = DraftPolicy(max_drafts=4)
    for r in rows:
        for _ in range(3):
            policy.observe_step(r, fixed + per_row * r)
    # 100 requests of 4 drafts: 100 * accept keep the first, of those accept keep the second...
    kept = [round(100 * accept**i) for i in range(1, 5)]
    for n in range(100):
        policy.observe_drafts(4, sum(1 for k in kept if n < k))
    return policy


def test_cold_start_allows_every_draft():
    policy = DraftPolicy(max_drafts=5)
    assert policy.cost_line() is None and policy.acceptance() is None
    assert policy.depth(rows=8, drafting=8) == 5
    policy.observe_step(4, 0.01)
    policy.observe_step(4, 0.01)
    assert policy.cost_line() is None  # one row count: no slope yet
    assert policy.depth(rows=8, drafting=8) == 5


def test_the_cost_line_is_the_fitted_one():
    policy = _fed(fixed=0.020, per_row=0.002, accept=0.5)
    fixed, per_row = policy.cost_line()
    assert fixed == pytest.approx(0.020) and per_row == pytest.approx(0.002)


def test_acceptance_counts_the_kept_prefix_per_position():
    policy = DraftPolicy(max_drafts=3)
    for _ in range(2 * MIN_PROPOSED):
        policy.observe_drafts(3, 1)  # first kept, second and third rejected
        policy.observe_drafts(1, 1)  # one draft, kept
    gains = policy.acceptance()
    assert gains[0] == pytest.approx(1.0)
    assert gains[1] == pytest.approx(0.0) and gains[2] == pytest.approx(0.0)


def test_a_position_with_few_proposals_takes_the_previous_figure():
    policy = DraftPolicy(max_drafts=3)
    for _ in range(MIN_PROPOSED):
        policy.observe_drafts(1, 1)
    policy.observe_drafts(2, 2)
    assert policy.acceptance() == pytest.approx([1.0, 1.0, 1.0])


def test_rejected_drafts_on_an_arithmetic_bound_step_get_none():
    # Each row costs what a request does (no fixed part to share) and drafts are mostly
    # rejected: every draft lowers tokens per second.
    policy = _fed(fixed=0.001, per_row=0.010, accept=0.2)
    assert policy.best_depth(rows=8, drafting=8) == 0


def test_kept_drafts_on_a_weight_bound_step_get_all():
    # Rows are nearly free next to reading the weights, and most drafts are kept (the step
    # costs were seen up to the rows every draft adds).
    policy = _fed(fixed=0.030, per_row=0.0002, accept=0.8, rows=(1, 4, 8, 16, 48, 96))
    assert policy.best_depth(rows=1, drafting=1) == 4
    assert policy.best_depth(rows=16, drafting=16) == 4


def test_the_best_count_weighs_both_sides():
    # Fixed part 20 ms, 2 ms per row; the first draft kept 90% of the time, the second 54%,
    # the third and fourth 32%. A draft pays where its chance of being kept beats the share
    # of the step's time that one more row adds: 2/22 at one request (every draft pays),
    # 64/84 at 32 requests (only the first).
    policy = DraftPolicy(max_drafts=4)
    for r in (1, 2, 5, 32, 64):
        for _ in range(3):
            policy.observe_step(r, 0.020 + 0.002 * r)
    for n in range(100):
        policy.observe_drafts(4, 0 if n >= 90 else 1 if n >= 54 else 2 if n >= 32 else 4)
    assert policy.acceptance() == pytest.approx([0.9, 0.54, 0.32, 0.32], abs=0.03)
    assert policy.best_depth(rows=1, drafting=1) == 4
    assert policy.best_depth(rows=32, drafting=32) == 1
    assert policy.best_depth(rows=32, drafting=2) == 1


def test_the_cost_curve_is_local_and_non_decreasing():
    # Up to 8 rows a step costs its 20 ms of weights; past that 2 ms a row. Drafts that a
    # third of the requests keep (all four) are free at one request and far too dear at 16.
    policy = DraftPolicy(max_drafts=4)
    for r in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        for _ in range(3):
            policy.observe_step(r, 0.020 + 0.002 * max(0, r - 8))
    for _ in range(4 * MIN_PROPOSED):
        policy.observe_drafts(4, 4)
        policy.observe_drafts(4, 0)
        policy.observe_drafts(4, 0)
    assert policy.best_depth(rows=1, drafting=1) == 4
    assert policy.best_depth(rows=16, drafting=16) == 0
    # A noisy count that costs less than a smaller one is pooled with it.
    noisy = DraftPolicy(max_drafts=1)
    for r, sec in ((2, 0.010), (3, 0.014), (4, 0.012), (6, 0.020)):
        for _ in range(2):
            noisy.observe_step(r, sec)
    curve = noisy.cost_curve()
    assert [r for r, _ in curve] == [2, 3, 4, 6]
    assert curve[1][1] == pytest.approx(0.013) and curve[2][1] == pytest.approx(0.013)
    assert step_seconds(curve, 1) == pytest.approx(0.010)
    assert step_seconds(curve, 5) == pytest.approx(0.0165)
    assert step_seconds(curve, 8) == pytest.approx(0.020 + 2 * 0.0035)
    # Past a flat end, at least the last point's seconds per row.
    flat = [(8, 0.030), (16, 0.030)]
    assert step_seconds(flat, 32) == pytest.approx(0.060)


def test_steps_that_verify_drafts_keep_their_own_cost_curve():
    # As on a GPU: a plain step replays its graph (2 ms at any of these sizes), a step with
    # drafts runs op by op (20 ms and more): even drafts that are always kept do not pay.
    policy = DraftPolicy(max_drafts=2)
    for r in (8, 16, 32):
        for _ in range(2):
            policy.observe_step(r, 0.002)
            policy.observe_step(2 * r, 0.020 + 0.0001 * r, drafted=True)
    for _ in range(2 * MIN_PROPOSED):
        policy.observe_drafts(2, 2)
    plain = policy.cost_curve(False)
    assert [r for r, _ in plain] == [8, 16, 32]
    assert [t for _, t in plain] == pytest.approx([0.002] * 3)
    assert policy.best_depth(rows=16, drafting=16) == 0
    # One pooled curve would have priced the plain step by its drafted neighbours.
    assert policy.cost_line(True) is not None and policy.cost_line(False)[1] == 0.0
    # Without plain steps of its own, the drafted curve stands in for them.
    only = DraftPolicy(max_drafts=2)
    for r in (8, 16, 32):
        for _ in range(2):
            only.observe_step(r, 0.020 + 0.0001 * r, drafted=True)
    for _ in range(2 * MIN_PROPOSED):
        only.observe_drafts(2, 2)
    assert only.cost_curve(False) is None and only.best_depth(rows=4, drafting=4) == 2


def _explorations(held: int) -> int:
    """Exploring decisions among ``held`` decisions in a row that hold drafts back."""
    gap, total, count = EXPLORE_EVERY, 0, 0
    while total + gap <= held:
        total, count, gap = total + gap, count + 1, min(2 * gap, MAX_EXPLORE_GAP)
    return count


def test_rows_are_priced_by_the_drafts_requests_propose():
    # Flat at 20 ms up to 24 rows, then 2 ms a row; every proposed draft kept half the time.
    def policy_with(proposals: list[int] | None) -> DraftPolicy:
        policy = DraftPolicy(max_drafts=4)
        for r in (8, 16, 24, 32, 48):
            for _ in range(2):
                policy.observe_step(r, 0.020 + 0.002 * max(0, r - 24))
                policy.observe_step(r, 0.020 + 0.002 * max(0, r - 24), drafted=True)
        for n in range(4 * MIN_PROPOSED):
            policy.observe_drafts(4, (0, 4)[n % 2])
        policy.observe_proposals(4, proposals or [])
        return policy

    # Every request offering all four drafts: two per request fill the flat part.
    assert policy_with(None).best_depth(rows=8, drafting=8) == 2
    # Half offer a second draft, a quarter a third and a fourth: allowing four adds 16 rows.
    offers = [1, 1, 2, 4] * (2 * MIN_PROPOSED)
    policy = policy_with(offers)
    assert policy.proposal_rates() == pytest.approx([1.0, 0.5, 0.25, 0.25], abs=0.02)
    assert policy.best_depth(rows=8, drafting=8) == 4


def test_exploration_allows_every_draft_less_often_while_nothing_changes():
    policy = _fed(fixed=0.001, per_row=0.010, accept=0.2)
    n = 32 + 64 + 128 + 256 + 256
    depths = [policy.depth(rows=8, drafting=8) for _ in range(n)]
    looks = [i for i, d in enumerate(depths) if d == 4]
    assert looks == [31, 95, 223, 479, 735]
    assert len(looks) == _explorations(n) and depths.count(0) == n - len(looks)
    assert policy.last_depth == 0


class _Best(DraftPolicy):
    """A policy whose figures always find ``best`` drafts best."""

    best = 0

    def best_depth(self, rows: int, drafting: int) -> int:
        return self.best


def test_a_decision_that_allows_every_draft_starts_the_waits_again():
    policy = _Best(max_drafts=4)
    assert [policy.depth(8, 8) for _ in range(96)].count(4) == 2  # looks at 32 and 96
    policy.best = 4
    assert policy.depth(8, 8) == 4
    policy.best = 0
    depths = [policy.depth(8, 8) for _ in range(EXPLORE_EVERY)]
    assert depths.count(4) == 1 and depths[-1] == 4


def test_an_exploring_step_adds_a_bounded_number_of_rows():
    policy = _Best(max_drafts=4)
    for drafting in (8, 16, 32, 64, 256):
        expected = min(4, max(1, EXPLORE_ROWS // drafting))
        depths = [policy.depth(drafting, drafting) for _ in range(MAX_EXPLORE_GAP)]
        assert max(depths) == expected and min(depths) == 0
    policy.best = 2
    assert max(policy.depth(256, 256) for _ in range(MAX_EXPLORE_GAP)) == 3  # one past it


def test_no_drafting_request_needs_no_decision():
    policy = _fed(fixed=0.001, per_row=0.010, accept=0.2)
    assert policy.depth(rows=8, drafting=0) == 4


def test_row_counts_not_seen_lately_leave_the_fit():
    policy = DraftPolicy(max_drafts=2)
    for _ in range(3):
        policy.observe_step(2, 0.004)
        policy.observe_step(6, 0.012)
    assert policy.cost_line() == pytest.approx((0.0, 0.002))
    for _ in range(COST_HORIZON):
        policy.observe_step(4, 0.010)
    assert policy.cost_line() is None  # one row count left


def test_plain_steps_do_not_age_the_drafted_ones_out():
    # A long stretch of free text (plain steps only) must not leave the drafted curve empty:
    # the plain one would then stand in for it and price drafts as cheap as plain rows.
    policy = DraftPolicy(max_drafts=2)
    for _ in range(2):
        policy.observe_step(24, 0.030, drafted=True)
        policy.observe_step(48, 0.032, drafted=True)
    for _ in range(3 * COST_HORIZON):
        policy.observe_step(8, 0.002)
        policy.observe_step(16, 0.002)
    assert [r for r, _ in policy.cost_curve(True)] == [24, 48]
    for _ in range(2 * MIN_PROPOSED):
        policy.observe_drafts(2, 2)
    assert policy.best_depth(rows=8, drafting=8) == 0


def test_nonsense_observations_are_ignored_and_bad_configs_refused():
    policy = DraftPolicy(max_drafts=2)
    policy.observe_step(0, 0.01)
    policy.observe_step(3, 0.0)
    policy.observe_step(3, float("nan"))
    assert policy.cost_line() is None
    policy.observe_drafts(9, 12)  # clamped to the positions there are
    assert policy.acceptance() is None
    with pytest.raises(ValueError, match="max_drafts"):
        DraftPolicy(max_drafts=0)
    with pytest.raises(ValueError, match="adaptive must be a bool"):
        SpeculativeConfig(adaptive="yes")


def _so(num: dict[str, int], drafts: dict[str, tuple[int, ...]], new: tuple = ()):
    return SchedulerOutput(
        step_id=1,
        new_requests=new,
        cached_requests=(),
        num_scheduled_tokens=num,
        total_num_scheduled_tokens=sum(num.values()),
        finished_request_ids=frozenset(),
        scheduled_spec_decode_tokens=drafts,
    )


def test_decode_rows_counts_decode_steps_only():
    assert decode_rows(_so({"a": 1, "b": 3}, {"b": (5, 6)})) == 4
    assert decode_rows(_so({"a": 7}, {})) is None  # a prompt chunk
    assert decode_rows(_so({}, {})) is None
    new = NewRequestData("c", (1, 2), (), None, None, (0,), 0)
    assert decode_rows(_so({"a": 1, "c": 1}, {}, (new,))) is None


# ------------------------------------------------------------------ in an engine
_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class _Recorded(DraftPolicy):
    """A policy whose figures are given (``best``: the count it always finds best), recording
    what the engine tells it."""

    def __init__(self, max_drafts: int, best: int) -> None:
        super().__init__(max_drafts)
        self.best = best
        self.steps: list[tuple[int, float]] = []
        self.verdicts: list[tuple[int, int]] = []
        self.decisions: list[tuple[int, int, int]] = []

    def best_depth(self, rows: int, drafting: int) -> int:
        return self.best

    def depth(self, rows: int, drafting: int) -> int:
        d = super().depth(rows, drafting)
        self.decisions.append((rows, drafting, d))
        return d

    def observe_step(self, rows: int, seconds: float, drafted: bool = False) -> None:
        self.steps.append((rows, seconds))
        super().observe_step(rows, seconds, drafted)

    def observe_drafts(self, proposed: int, accepted: int) -> None:
        self.verdicts.append((proposed, accepted))
        super().observe_drafts(proposed, accepted)


def _json_requests(n: int) -> list[tuple[str, SamplingParams]]:
    sp = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=_SCHEMA)
    )
    free = SamplingParams(max_tokens=12, temperature=0.0)
    return [(f"Person number {i} as JSON:", sp) for i in range(n)] + [("Once upon", free)]


@pytest.fixture(scope="module")
def drafting_engine(tiny_model_dir):
    spec = {"method": "auto", "num_speculative_tokens": 3, "adaptive": True}
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            async_scheduling=False,
            speculative_config=spec,
            max_model_len=256,
        )
    )
    yield engine
    engine.shutdown()


def _run(engine: LLMEngine, policy: DraftPolicy | None) -> tuple[dict, int]:
    sched = engine.core.scheduler
    sched.draft_policy = policy
    drafted = sched.num_draft_tokens
    got = run_to_end(engine, _json_requests(4))
    return got, sched.num_draft_tokens - drafted


def test_the_engine_builds_an_adaptive_policy(drafting_engine):
    policy = drafting_engine.core.scheduler.draft_policy
    assert isinstance(policy, DraftPolicy) and policy.max_drafts == 3
    assert drafting_engine.stats()["spec_draft_depth"] == 3


def test_the_scheduler_drafts_as_deep_as_the_policy_says(drafting_engine):
    expected, fixed_drafts = _run(drafting_engine, None)
    assert fixed_drafts > 0
    for rid in ("r0", "r1", "r2", "r3"):
        if expected[rid][1] == "stop":
            jsonschema.validate(json.loads(expected[rid][2]), _SCHEMA)

    none = _Recorded(3, best=0)
    got, drafted = _run(drafting_engine, none)
    assert got == expected
    # Only the exploring decisions let drafts through (see _explorations); a
    # step with no drafting request (the first: none running yet) is no decision.
    held = [d for _, drafting, d in none.decisions if drafting]
    explored = held.count(3)
    assert explored == _explorations(len(held)) and held.count(0) == len(held) - explored
    assert drafted <= explored * 3 * 4
    assert drafting_engine.stats()["spec_draft_depth"] == 0

    one = _Recorded(3, best=1)
    got, drafted = _run(drafting_engine, one)
    assert got == expected and drafted > 0
    # Each verification saw at most one draft outside the exploring decisions.
    assert all(p <= 3 and 0 <= a <= p for p, a in one.verdicts)
    explored = sum(1 for _, drafting, d in one.decisions if drafting and d == 3)
    assert sum(1 for p, _ in one.verdicts if p > 1) <= explored * 5


def test_the_engine_reports_decode_steps_with_their_rows(drafting_engine):
    policy = _Recorded(3, best=3)
    _run(drafting_engine, policy)
    assert policy.steps and policy.verdicts
    # Each decode step had at most 5 requests, each with its token and up to 3 drafts.
    assert all(1 <= rows <= 5 * 4 and seconds > 0 for rows, seconds in policy.steps)
    # An explicit speculative_config drafts for free text too: every running request.
    assert all(drafting == rows for rows, drafting, _ in policy.decisions)
