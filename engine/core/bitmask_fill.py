"""A step's grammar bitmask fill: begun once (``Scheduler.begin_fill``), waited for once.

Rows are filled per backend in one batched call each. A backend's Python side of its call
(``GrammarBackend.plan_fill``) runs when the fill begins; its native part (xgrammar's and
llguidance's batched fills release the GIL) runs then too, or on the fill thread when the
caller hands one over and its governor says the thread pays (``fill_thread.py``): the
engine thread then applies the rest of a step's tokens and schedules the next step
meanwhile. ``BitmaskFill.wait`` returns the same either way.

When a batched call raises, that backend's rows are filled one by one instead; a request
whose own row fails gets an all-allowed row and fails (its token is dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from baton.engine.core.fill_thread import FillThread, PendingFills, run_fills
from baton.engine.core.request import Request
from baton.engine.scheduler_output import EngineCoreOutput, GrammarOutput
from baton.grammar.backend import GrammarMatcher, NativeFill, filled_now
from baton.grammar.reasoning import ReasoningMatcher, fill_thinking_row

if TYPE_CHECKING:
    from baton.engine.core.structured_outputs import StructuredOutputManager

logger = logging.getLogger(__name__)

# The fill group of the requests that are thinking (``grammar/reasoning.py``): no backend's.
_THINKING = "(thinking)"

# One backend's share of a fill: its name, requests, their matchers and their rows.
_Group = tuple[str, list[Request], list[GrammarMatcher], list[int]]
# How the owner of the requests fails one (``Scheduler._fail``): its error output.
Fail = Callable[[Request, str], EngineCoreOutput]


class BitmaskFill:
    """A step's bitmask being filled; ``wait`` for its rows before sampling with them.

    Until ``wait`` returns, the rows must not be read and the fill's matchers must not
    change (a fill on the fill thread reads them); scheduling without a drafter does
    neither.
    """

    def __init__(
        self,
        grammar: GrammarOutput | None,
        fail: Fail,
        groups: Sequence[_Group] = (),
        pending: PendingFills | None = None,
        broken: Sequence[tuple[Request, str]] = (),
        plan_errors: Mapping[int, BaseException] | None = None,
    ) -> None:
        self._grammar = grammar
        self._fail = fail
        self._groups = groups
        self._pending = pending
        self._broken = list(broken)
        self._plan_errors = dict(plan_errors or {})

    @classmethod
    def begin(
        cls,
        structured: StructuredOutputManager,
        requests: Sequence[Request],
        fail: Fail,
        out: torch.Tensor | None = None,
        drafts: Mapping[str, Sequence[int]] | None = None,
        thread: FillThread | None = None,
    ) -> BitmaskFill:
        """Begins filling a row for each of ``requests`` that has a matcher, into ``out``
        (int32 ``[rows, words]``, e.g. the device's shared buffer) or the manager's own
        buffer. ``fail`` fails a request whose row could not be filled, at ``wait``.

        With ``drafts`` (speculative decoding) a request with k draft tokens gets 1 + k
        consecutive rows: the mask after its known tokens, then after each draft in turn (its
        matcher is advanced over the drafts between batched fills and rolled back at the end);
        such a fill is done here, whole. Otherwise the native part of each batched call may
        run on ``thread`` (when its governor says it pays) while the caller works.
        """
        reqs = [r for r in requests if r.structured is not None and r.structured.matcher]
        if not reqs:
            return cls(None, fail)
        if drafts:
            grammar, broken = _draft_rows(structured, reqs, out, drafts)
            return cls(grammar, fail, broken=broken)
        bitmask = structured.bitmask_rows(len(reqs), out)
        on_thread = thread is not None and thread.worthwhile()
        groups, calls, errors = _plan(structured, reqs, range(len(reqs)), bitmask, on_thread)
        pending = thread.start(calls) if thread is not None and on_thread else run_fills(calls)
        # A view of a preallocated buffer: valid until it is filled again.
        grammar = GrammarOutput(tuple(r.request_id for r in reqs), bitmask)
        return cls(grammar, fail, groups, pending, plan_errors=errors)

    def wait(self) -> tuple[GrammarOutput | None, list[EngineCoreOutput]]:
        """Waits for the fill: the step's bitmask rows (None: no structured row), and the
        error outputs of the requests whose grammar failed to fill its row (they are
        finished; the token sampled for them is dropped). A request finished meanwhile (by
        the update the fill ran beside) is left as it is. Call it once."""
        broken = self._broken
        if self._pending is not None and self._grammar is not None:
            errors = {**self._pending.wait(), **self._plan_errors}
            broken = broken + _fall_back(self._groups, errors, self._grammar.bitmask)
        failed = []
        for req, message in broken:
            if req.is_finished:
                continue
            logger.error("request %s failed: %s", req.request_id, message)
            failed.append(self._fail(req, message))
        return self._grammar, failed


def _plan(
    structured: StructuredOutputManager,
    reqs: Sequence[Request],
    rows: Sequence[int],
    bitmask: torch.Tensor,
    off_thread: bool,
) -> tuple[list[_Group], list[NativeFill], dict[int, BaseException]]:
    """Plans the fill of ``bitmask[rows[i]]`` for ``reqs[i]``'s matcher, one batched call per
    backend: the groups, their native calls (in the same order) and, by group index, the
    error each group's planning raised (its call then does nothing)."""
    groups = _by_backend(reqs, rows)
    calls: list[NativeFill] = []
    errors: dict[int, BaseException] = {}
    for i, (name, _, matchers, group_rows) in enumerate(groups):
        try:
            if name == _THINKING:  # every token but the ends, or the end of thoughts
                for matcher, row in zip(matchers, group_rows, strict=True):
                    assert isinstance(matcher, ReasoningMatcher)
                    fill_thinking_row(matcher, bitmask, row)
                call = filled_now
            else:
                call = structured.service.backend(name).plan_fill(
                    matchers, bitmask, group_rows, off_thread=off_thread
                )
        except Exception as exc:  # noqa: BLE001 - filled row by row in _fall_back
            errors[i], call = exc, filled_now
        calls.append(call)
    return groups, calls, errors


def _fall_back(
    groups: Sequence[_Group], errors: Mapping[int, BaseException], bitmask: torch.Tensor
) -> list[tuple[Request, str]]:
    """Fills row by row each group whose batched fill raised (``errors`` by group index); a
    request whose own row fails gets an all-allowed row and is returned, with why."""
    failed: list[tuple[Request, str]] = []
    for i, (backend, reqs, matchers, rows) in enumerate(groups):
        error = errors.get(i)
        if error is None:
            continue
        logger.error("batched %s bitmask fill failed; filling row by row", backend, exc_info=error)
        for req, matcher, row in zip(reqs, matchers, rows, strict=True):
            try:
                matcher.fill_bitmask(bitmask, row)
            except Exception as exc:  # noqa: BLE001 - the caller fails this request
                # Not all-zero: a row that allows nothing would break sampling for the batch.
                bitmask[row].fill_(-1)
                failed.append((req, f"grammar bitmask fill failed: {type(exc).__name__}: {exc}"))
    return failed


def _fill_now(
    structured: StructuredOutputManager,
    reqs: Sequence[Request],
    rows: Sequence[int],
    bitmask: torch.Tensor,
) -> list[tuple[Request, str]]:
    """Fills ``bitmask[rows[i]]`` for ``reqs[i]``'s matcher here, one batched call per backend."""
    groups, calls, errors = _plan(structured, reqs, rows, bitmask, off_thread=False)
    return _fall_back(groups, {**run_fills(calls).wait(), **errors}, bitmask)


def _draft_rows(
    structured: StructuredOutputManager,
    reqs: Sequence[Request],
    out: torch.Tensor | None,
    drafts: Mapping[str, Sequence[int]],
) -> tuple[GrammarOutput, list[tuple[Request, str]]]:
    """The rows of a step with drafts (``BitmaskFill.begin``), and the requests whose fill
    failed, each once with its first reason."""
    counts = [1 + len(drafts.get(r.request_id, ())) for r in reqs]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    total = sum(counts)
    bitmask = structured.bitmask_rows(total, out)
    failed = _fill_now(structured, reqs, starts, bitmask)
    advanced = [0] * len(reqs)
    try:
        for j in range(1, max(counts)):
            live, rows = [], []
            for i, req in enumerate(reqs):
                if counts[i] <= j:
                    continue
                row = starts[i] + j
                if advanced[i] == j - 1 and _accepts(
                    req.structured.matcher, drafts[req.request_id][j - 1]
                ):
                    advanced[i] = j
                    live.append(req)
                    rows.append(row)
                else:
                    # The draft before is masked out at its own row, so it is never
                    # accepted and nothing from here on is either.
                    bitmask[row].fill_(-1)
            if live:
                failed += _fill_now(structured, live, rows, bitmask)
    finally:
        for req, n in zip(reqs, advanced, strict=True):
            if n:
                req.structured.matcher.rollback(n)
    broken = {id(r) for r, _ in failed}
    unique = []
    for req, message in failed:
        if id(req) in broken:
            broken.discard(id(req))
            unique.append((req, message))
    return GrammarOutput(tuple(r.request_id for r in reqs), bitmask, tuple(counts)), unique


def _by_backend(reqs: Sequence[Request], rows: Sequence[int]) -> list[_Group]:
    """``reqs`` (with their rows) grouped by backend: (name, requests, matchers, rows), the
    biggest group first. On the fill thread only the first call is sure to run beside the
    caller's Python (each later one needs the GIL to start)."""
    if len(rows) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(rows)} rows")
    if not reqs:
        return []
    states = [req.structured for req in reqs]
    names = [state.backend for state in states]
    first = names[0]
    if names.count(first) == len(names) and all(state.reasoning is None for state in states):
        # Every request on one backend, the usual case: no per-request grouping (a step
        # fills every structured row, so this runs once per step on the engine thread).
        return [(first, list(reqs), [state.matcher for state in states], list(rows))]
    by_backend: dict[str, tuple[list[Request], list[GrammarMatcher], list[int]]] = {}
    for req, state, row in zip(reqs, states, rows, strict=True):
        name, matcher = state.backend, state.matcher
        if isinstance(matcher, ReasoningMatcher):  # thinking: filled here; else its grammar's
            name, matcher = (_THINKING, matcher) if matcher.thinking else (name, matcher.inner)
        group = by_backend.setdefault(name, ([], [], []))
        group[0].append(req)
        group[1].append(matcher)
        group[2].append(row)
    ordered = sorted(by_backend.items(), key=lambda item: -len(item[1][0]))
    return [(name, *group) for name, group in ordered]


def _accepts(matcher: GrammarMatcher, token: int) -> bool:
    """Advances ``matcher`` by a draft token; False when the grammar rejects it or the matcher
    fails (the draft is then masked out at its own row, so it is never kept)."""
    try:
        return matcher.accept_tokens([token])
    except Exception:  # noqa: BLE001 - a broken matcher costs its request the draft only
        logger.exception("advancing a matcher over a draft token failed")
        return False
