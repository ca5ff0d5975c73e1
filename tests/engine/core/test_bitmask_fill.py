"""BitmaskFill: a step's bitmask fill, the same rows and failures whether its native part
runs on the fill thread or inline."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from baton.engine.core.bitmask_fill import BitmaskFill
from baton.engine.core.fill_thread import FillGovernor, FillThread
from baton.engine.core.request import Request, RequestStatus, StructuredState
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import EngineCoreOutput
from baton.grammar.backend import allocate_bitmask
from baton.grammar.spec import StructuredOutputsParams

VOCAB = 96


class RowMatcher:
    """Fills its row with one value (a row's words all equal), or raises when ``broken``."""

    def __init__(self, value: int, broken: bool = False) -> None:
        self.value = value
        self.broken = broken

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.broken:
            raise RuntimeError(f"planted row failure {self.value}")
        bitmask[row].fill_(self.value)


class BatchBackend:
    """``plan_fill`` as a batched backend's: the rows are filled by the returned call, which
    notes the thread it ran on and raises when ``fail_batch``."""

    def __init__(self, fail_batch: bool = False) -> None:
        self.fail_batch = fail_batch
        self.off_thread: list[bool] = []
        self.ran_on: list[int] = []

    def plan_fill(
        self,
        matchers: Sequence[RowMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        off_thread: bool = False,
    ) -> Callable[[], None]:
        self.off_thread.append(off_thread)

        def native() -> None:
            self.ran_on.append(threading.get_ident())
            if self.fail_batch:
                raise RuntimeError("planted batch failure")
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.fill_bitmask(bitmask, row)

        return native


class Manager:
    """The two things a fill asks of ``StructuredOutputManager``."""

    def __init__(self, backend: BatchBackend) -> None:
        self.service = SimpleNamespace(backend=lambda name: backend)
        self._bitmask = allocate_bitmask(8, VOCAB)

    def bitmask_rows(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return (self._bitmask if out is None else out)[:n]


def requests(*matchers: RowMatcher | None) -> list[Request]:
    reqs = []
    for i, matcher in enumerate(matchers):
        req = Request.new(f"r{i}", [1, 2], SamplingParams(max_tokens=4), (0,), 0)
        req.status = RequestStatus.RUNNING
        spec = StructuredOutputsParams(regex="a+")
        req.structured = StructuredState(spec=spec, matcher=matcher, backend="batch")
        reqs.append(req)
    return reqs


class Failures:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def __call__(self, req: Request, message: str) -> EngineCoreOutput:
        self.failed.append((req.request_id, message))
        req.status = RequestStatus.FINISHED_ERROR
        return EngineCoreOutput(req.request_id, [], finish_reason="error", error=message)


def test_the_thread_and_an_inline_fill_give_the_same_rows() -> None:
    reqs = requests(RowMatcher(1), None, RowMatcher(2), RowMatcher(3))  # r1: still compiling
    paused = FillGovernor(window=1, max_held=0.5, pause=1)
    paused.record(native_s=1.0, held_s=1.0)  # the next fill stays on the engine thread
    results = {}
    for mode, thread in (
        ("inline", None),
        ("thread", FillThread()),
        ("paused", FillThread(governor=paused)),
    ):
        backend, fail = BatchBackend(), Failures()
        try:
            fill = BitmaskFill.begin(Manager(backend), reqs, fail, thread=thread)
            grammar, failed = fill.wait()
        finally:
            if thread is not None:
                thread.shutdown()
        assert grammar is not None and failed == [] and fail.failed == []
        assert grammar.request_ids == ("r0", "r2", "r3")
        assert grammar.bitmask[:, 0].tolist() == [1, 2, 3]
        on_thread = backend.ran_on != [threading.get_ident()]
        results[mode] = (backend.off_thread, on_thread)
    assert results == {
        "inline": ([False], False),
        "thread": ([True], True),
        "paused": ([False], False),
    }


def test_a_failed_batch_falls_back_to_rows_and_fails_only_live_requests_whose_row_fails() -> None:
    reqs = requests(RowMatcher(1), RowMatcher(2, broken=True), RowMatcher(3, broken=True))
    out = allocate_bitmask(4, VOCAB).zero_()
    thread, fail = FillThread(), Failures()
    try:
        fill = BitmaskFill.begin(
            Manager(BatchBackend(fail_batch=True)), reqs, fail, out, thread=thread
        )
        reqs[2].status = RequestStatus.FINISHED_STOPPED  # finished by the update beside the fill
        grammar, failed = fill.wait()
    finally:
        thread.shutdown()
    assert grammar is not None and grammar.bitmask.data_ptr() == out.data_ptr()
    # The broken rows allow everything: an all-zero row would break sampling for the batch.
    assert grammar.bitmask[:3, 0].tolist() == [1, -1, -1]
    assert [o.request_id for o in failed] == ["r1"] and failed[0].finish_reason == "error"
    assert fail.failed == [
        ("r1", "grammar bitmask fill failed: RuntimeError: planted row failure 2")
    ]


def test_no_row_to_fill_gives_no_grammar() -> None:
    backend, fail = BatchBackend(), Failures()
    assert BitmaskFill.begin(Manager(backend), requests(None), fail).wait() == (None, [])
    assert backend.off_thread == [] and fail.failed == []


def test_bitmask_rows_keeps_one_view_per_buffer_and_row_count(tokenizer) -> None:
    # The mp executor alternates two slot buffers: each keeps its views (the backends know a
    # view by identity); a buffer too small for the rows gives the own buffer, grown.
    from baton.engine.core.structured_outputs import StructuredOutputManager

    vocab = tokenizer.vocab_size
    manager = StructuredOutputManager(tokenizer, vocab, max_rows=4)
    try:
        slots = [allocate_bitmask(8, vocab), allocate_bitmask(8, vocab)]
        first = [manager.bitmask_rows(3, slot) for slot in slots]
        for _ in range(3):
            assert all(manager.bitmask_rows(3, s) is v for s, v in zip(slots, first, strict=True))
        for slot, view in zip(slots, first, strict=True):
            assert view.shape[0] == 3 and view.data_ptr() == slot.data_ptr()
        own = manager.bitmask_rows(2)
        assert manager.bitmask_rows(2) is own
        grown = manager.bitmask_rows(16, slots[0])
        assert grown.shape[0] == 16 and grown.data_ptr() != slots[0].data_ptr()
        assert manager.bitmask_rows(16) is grown
    finally:
        manager.shutdown()
