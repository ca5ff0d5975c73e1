"""How many drafts a step carries: only as many as their expected tokens pay for.

A draft is a row of the step's forward, sampler and bitmask. Where the step is bound by
reading the weights (a small batch on a GPU, one row of a dense model on a CPU) a few more
rows cost almost nothing and drafts are a clear win; where it is bound by arithmetic (the CPU's
quantised kernels, or any batch of 8-16 rows on a CPU) each row costs about as much as a
request's own, and a draft the model rejects slows every request in the batch. Measured
in-process on an AMD EPYC Genoa, 2 threads, with ``bench/offline/engine.py``'s JSON-person requests,
JSON objects per second with up to 5 drafts a step against none: the default model in GGUF
Q4_1 gains 1.2-1.6x from drafts at batch 1-16; a random-weight 1B-shape Q4_K_M model, whose
drafts are mostly rejected, loses 20% at batch 1 and 27-34% at batch 8-16; the default model
dense in bfloat16 gains 1.3x at batch 1 and loses 11-24% at batch 8-16. No fixed count is
right for all three, so the policy measures both sides while the engine runs:

- the step's cost by its rows: an average time per row count of the decode steps seen
  (``observe_step``), made non-decreasing and joined by lines (``cost_curve``): a few more
  rows may be nearly free at one batch size and cost their full share at another. Steps that
  verify drafts keep their own curve: on a GPU they leave the decode CUDA graphs, and the
  simulated H200's check put such a step at 10-20 ms where a plain one took 2;
- each draft position's acceptance: of the drafts proposed at position i (the i-th draft of a
  request in a step), the share whose step kept the first i (``observe_drafts``);
- each position's proposal rate: of the requests allowed an i-th draft, the share whose
  drafter found one (``observe_proposals``): a step's added rows are the drafts proposed.

``depth`` then picks the draft count per request that maximises the step's expected tokens
per second. Until both sides are known it allows every draft (the engine's behaviour without
the policy), and now and then, while it holds drafts back, it allows more again (a bounded
number of rows), so that the acceptance figures stay current and the cost curves keep seeing
row counts beyond the chosen ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from baton.engine.scheduler_output import SchedulerOutput

# After this many decisions that allow fewer drafts than the most, one allows more (fresh
# acceptance figures, and row counts past the chosen ones); each such look that changes
# nothing doubles the wait, up to MAX_EXPLORE_GAP (below COST_HORIZON, so that the look keeps
# the costly row counts in the fit). Where a draft step costs ten times a plain one (a GPU
# step that leaves its CUDA graph) a look every 32 steps would cost a quarter of the time.
EXPLORE_EVERY = 32
MAX_EXPLORE_GAP = 256
# An exploring step adds about this many draft rows at most (at least one draft per request):
# at batch 256 every draft would add 1280 rows, a step several times a plain one's time.
EXPLORE_ROWS = 64
# Steps a row count's average weighs before the fit uses it, and the most any one weighs.
MIN_COST_SAMPLES = 2
MAX_COST_WEIGHT = 8
# The weight of the newest step in a row count's average (older ones fade).
COST_SMOOTHING = 0.25
# Row counts not seen in this many steps of their kind (plain or drafted) leave the fit (the
# machine's load may have changed).
COST_HORIZON = 512
# Drafts proposed at position 1 before its acceptance is trusted.
MIN_PROPOSED = 16
# Each observation fades the earlier ones by this factor (about the last 500 drafts count).
ACCEPT_DECAY = 1.0 - 1.0 / 512


class _PositionShares:
    """Per draft position, faded counts of trials and of hits: a trial of ``n`` covers
    positions 1..n, a hit of ``h`` positions 1..h (h <= n)."""

    def __init__(self, positions: int) -> None:
        self.trials = [0.0] * positions
        self.hits = [0.0] * positions

    def add(self, outcomes: Sequence[tuple[int, int]]) -> None:
        """Adds (trial, hit) outcomes, each fading the earlier counts by ``ACCEPT_DECAY``
        (one fade for the batch: per-outcome loops would cost every request of a step)."""
        if not outcomes:
            return
        k = len(self.trials)
        fade = ACCEPT_DECAY ** len(outcomes)
        tried, hit = [0] * (k + 1), [0] * (k + 1)
        for n, h in outcomes:
            n = max(0, min(n, k))
            tried[n] += 1
            hit[max(0, min(h, n))] += 1
        more_tried = more_hit = 0
        for i in range(k - 1, -1, -1):  # outcomes reaching past position i
            more_tried += tried[i + 1]
            more_hit += hit[i + 1]
            self.trials[i] = self.trials[i] * fade + more_tried
            self.hits[i] = self.hits[i] * fade + more_hit


@dataclass
class _RowCost:
    seconds: float
    count: int
    last_seen: int


@dataclass
class DraftPolicy:
    """Chooses each step's drafts per request from measured step costs and acceptance.

    Args:
        max_drafts: the most drafts per request and step (``num_speculative_tokens``).

    Attributes:
        last_depth: the count the last decision chose by the figures (an exploring
            decision's ``max_drafts`` aside).

    Raises:
        ValueError: ``max_drafts`` < 1.
    """

    max_drafts: int
    last_depth: int = field(default=0, init=False)
    _costs: dict[tuple[bool, int], _RowCost] = field(default_factory=dict, init=False, repr=False)
    # Per position: drafts proposed there and kept (with all before them); requests allowed
    # a draft there and those whose drafter proposed one.
    _kept: _PositionShares = field(init=False, repr=False)
    _offered: _PositionShares = field(init=False, repr=False)
    # Decode steps seen, without drafts and with: a row count's age is counted in steps of
    # its own kind, so that a long stretch of plain steps does not age the drafted ones out.
    _steps: dict[bool, int] = field(
        default_factory=lambda: {False: 0, True: 0}, init=False, repr=False
    )
    _held_back: int = field(default=0, init=False, repr=False)
    _explore_gap: int = field(default=EXPLORE_EVERY, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_drafts < 1:
            raise ValueError(f"DraftPolicy.max_drafts must be >= 1, got {self.max_drafts}")
        self.last_depth = self.max_drafts
        self._kept = _PositionShares(self.max_drafts)
        self._offered = _PositionShares(self.max_drafts)

    # ------------------------------------------------------------- observations
    def observe_step(self, rows: int, seconds: float, drafted: bool = False) -> None:
        """Records a decode step of ``rows`` rows (requests and their drafts) that took
        ``seconds`` from one step to the next; ``drafted``: it verified drafts (such a step
        may take another path than a plain one of as many rows: on a GPU, outside the
        decode CUDA graphs)."""
        if rows < 1 or not seconds > 0.0:
            return
        self._steps[drafted] = now = self._steps[drafted] + 1
        if now % COST_HORIZON == 0:
            self._costs = {
                k: c
                for k, c in self._costs.items()
                if k[0] != drafted or c.last_seen > now - COST_HORIZON
            }
        cost = self._costs.get((drafted, rows))
        if cost is None:
            self._costs[drafted, rows] = _RowCost(seconds, 1, now)
            return
        cost.seconds += COST_SMOOTHING * (seconds - cost.seconds)
        cost.count += 1
        cost.last_seen = now

    def observe_proposals(self, allowed: int, proposed: Sequence[int]) -> None:
        """Records a step's drafting: each request was allowed ``allowed`` drafts at most and
        its drafter found ``proposed[i]`` (often fewer: a forced text's few tokens, no n-gram
        match), so that a step's rows are priced by the drafts requests really add."""
        self._offered.add([(allowed, n) for n in proposed])

    def observe_drafts(self, proposed: int, accepted: int) -> None:
        """Records one request's verification: ``proposed`` drafts, the first ``accepted``
        of them kept."""
        self._kept.add([(proposed, accepted)])

    # ----------------------------------------------------------------- decision
    def depth(self, rows: int, drafting: int) -> int:
        """Drafts per request for a step of ``rows`` decoding requests, ``drafting`` of which
        may draft: the count whose expected tokens per second is highest by the figures so
        far (``max_drafts`` while they are too few). On the exploring decisions (after
        ``EXPLORE_EVERY`` decisions that allow fewer, then after twice as many each time, up
        to ``MAX_EXPLORE_GAP``, until a decision allows them all again) it allows more: all,
        or as many as add about ``EXPLORE_ROWS`` rows, and at least one more than the best."""
        if drafting < 1:
            return self.max_drafts
        best = self.best_depth(rows, drafting)
        self.last_depth = best
        if best >= self.max_drafts:
            self._held_back, self._explore_gap = 0, EXPLORE_EVERY
            return best
        self._held_back += 1
        if self._held_back >= self._explore_gap:
            self._held_back = 0
            self._explore_gap = min(2 * self._explore_gap, MAX_EXPLORE_GAP)
            return max(best + 1, min(self.max_drafts, EXPLORE_ROWS // drafting))
        return best

    def best_depth(self, rows: int, drafting: int) -> int:
        """``depth`` without the exploration: the best count by the figures so far, or
        ``max_drafts`` while they are too few."""
        plain, drafted = self.cost_curve(False), self.cost_curve(True)
        gains = self.acceptance()
        if gains is None or (plain is None and drafted is None):
            return self.max_drafts
        # Where one kind of step was not seen enough, the other's curve stands in for it.
        plain, drafted = plain or drafted, drafted or plain
        assert plain is not None and drafted is not None
        offered = self.proposal_rates()
        best_k, best_rate = 0, rows / step_seconds(plain, rows)
        tokens, added = float(rows), 0.0
        for k in range(1, self.max_drafts + 1):
            # Of the requests allowed a k-th draft, the share whose drafter finds one.
            tokens += drafting * offered[k - 1] * gains[k - 1]
            added += drafting * offered[k - 1]
            rate = tokens / step_seconds(drafted, rows + round(added))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def cost_curve(self, drafted: bool = False) -> list[tuple[int, float]] | None:
        """A decode step's seconds by its rows (of steps that verified drafts, or of plain
        ones: ``drafted``), as (rows, seconds) points in increasing
        rows: each recent row count's average, made non-decreasing (adjacent counts that
        disagree are pooled, weighted by their steps); None until two row counts have
        ``MIN_COST_SAMPLES`` steps. Between the points a step costs what the line between
        them gives, so a batch where a few more rows are nearly free (bound by reading the
        weights) and one where every row counts are each judged by their own part of it."""
        points = self._recent_points(drafted)
        if len(points) < 2:
            return None
        pooled: list[list[float]] = []  # [first index, last index, weighted sum, weight]
        for i, (_, seconds, weight) in enumerate(points):
            pooled.append([i, i, seconds * weight, weight])
            while len(pooled) > 1 and pooled[-2][2] * pooled[-1][3] > pooled[-1][2] * pooled[-2][3]:
                last = pooled.pop()
                pooled[-1][1], pooled[-1][2], pooled[-1][3] = (
                    last[1],
                    pooled[-1][2] + last[2],
                    pooled[-1][3] + last[3],
                )
        curve = []
        for first, last, total, weight in pooled:
            curve += [(points[i][0], total / weight) for i in range(int(first), int(last) + 1)]
        return curve

    def cost_line(self, drafted: bool = False) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row) of a decode step (``drafted`` as ``cost_curve``):
        the line fitted by weighted least squares to the recent row counts' averages (a summary
        for ``LLM.stats()``; decisions use ``cost_curve``); None until two row counts have
        ``MIN_COST_SAMPLES`` steps."""
        points = self._recent_points(drafted)
        if len(points) < 2:
            return None
        total = sum(w for _, _, w in points)
        mean_r = sum(r * w for r, _, w in points) / total
        mean_s = sum(s * w for _, s, w in points) / total
        var = sum(w * (r - mean_r) ** 2 for r, _, w in points)
        cov = sum(w * (r - mean_r) * (s - mean_s) for r, s, w in points)
        per_row = max(0.0, cov / var)
        fixed = mean_s - per_row * mean_r
        if fixed <= 0.0:  # rows explain all of it
            fixed, per_row = 0.0, mean_s / mean_r
        return fixed, per_row

    def _recent_points(self, drafted: bool) -> list[tuple[int, float, int]]:
        """(rows, average seconds, weight) of the row counts of ``drafted`` steps (or plain
        ones) with enough recent steps, in increasing rows."""
        return sorted(
            (rows, c.seconds, min(c.count, MAX_COST_WEIGHT))
            for (kind, rows), c in self._costs.items()
            if kind == drafted
            and c.count >= MIN_COST_SAMPLES
            and self._steps[drafted] - c.last_seen < COST_HORIZON
        )

    def proposal_rates(self) -> list[float]:
        """Per draft position, the share of the requests allowed a draft there whose drafter
        proposed one; 1.0 at a position with fewer than ``MIN_PROPOSED`` allowed."""
        shares = self._offered
        return [
            offered / allowed if allowed >= MIN_PROPOSED else 1.0
            for allowed, offered in zip(shares.trials, shares.hits, strict=True)
        ]

    def acceptance(self) -> list[float] | None:
        """Per draft position, the expected tokens a proposed draft there adds (the share of
        proposals whose step kept it and every draft before it); None until position 1 has
        ``MIN_PROPOSED`` proposals. A position with too few proposals of its own takes the
        figure of the one before it."""
        shares = self._kept
        if shares.trials[0] < MIN_PROPOSED:
            return None
        out: list[float] = []
        for proposed, accepted in zip(shares.trials, shares.hits, strict=True):
            if proposed >= MIN_PROPOSED or not out:
                out.append(accepted / proposed)
            else:
                out.append(out[-1])
        return out


def decode_rows(so: SchedulerOutput) -> int | None:
    """The rows of a step that only decodes (each request feeds its last token and its
    drafts), or None for a step with prompt tokens, whose cost is another matter."""
    if so.new_requests or not so.num_scheduled_tokens:
        return None
    spec = so.scheduled_spec_decode_tokens
    for rid, n in so.num_scheduled_tokens.items():
        if n != 1 + len(spec.get(rid, ())):
            return None
    return so.total_num_scheduled_tokens


def step_seconds(curve: list[tuple[int, float]], rows: int) -> float:
    """A decode step's seconds at ``rows`` by ``curve`` (``DraftPolicy.cost_curve``): the
    first point's below it, the line between the two points around it, and past the last
    point the last two points' slope or, if steeper, the last point's seconds per row (rows
    never seen are not taken to be free: a flat end of the curve would price any number of
    drafts at nothing)."""
    if rows <= curve[0][0]:
        return curve[0][1]
    for (r0, s0), (r1, s1) in zip(curve, curve[1:], strict=False):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    (r0, s0), (r1, s1) = curve[-2], curve[-1]
    return s1 + max((s1 - s0) / (r1 - r0), s1 / r1) * (rows - r1)
