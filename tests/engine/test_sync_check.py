"""Tests for the engine's sync-check debug mode (``BATON_SYNC_CHECK``)."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from baton.engine.sync_check import (
    SYNC_CHECK_ENV,
    SyncChecker,
    SyncCheckError,
    SyncCheckWarning,
    sync_check_mode_from_env,
)

LOGGER_NAME = "baton.engine.sync_check"


def _stack_lengths() -> tuple[int, int]:
    """Depths of this thread's torch dispatch-mode and function-mode stacks."""
    return torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()


def _planted_read(tensor: torch.Tensor) -> float:
    return tensor.item()  # the planted read the tests look for


PLANTED_LINE = _planted_read.__code__.co_firstlineno + 1
PLANTED_FILE = _planted_read.__code__.co_filename


def _meta_to_host(convert: Callable[[torch.Tensor], object]) -> Callable[[], None]:
    """A device-to-host conversion of a non-CPU tensor. A meta tensor stands in for a CUDA one on
    this CPU-only machine; it has no data, so in warn mode (where the op still runs) the copy
    itself fails after the report."""

    def op() -> None:
        with contextlib.suppress(NotImplementedError):
            convert(torch.empty(3, device="meta"))

    return op


def _vector() -> torch.Tensor:
    return torch.tensor([1.0, 0.0, 2.0])


def _scalar() -> torch.Tensor:
    return torch.tensor(3.0)


FLAGGED_OPS: dict[str, Callable[[], object]] = {
    "item": lambda: _scalar().item(),
    "bool": lambda: bool(_scalar()),
    "int": lambda: int(_scalar()),
    "float": lambda: float(_scalar()),
    "index_of_list": lambda: [0, 1, 2, 3][torch.tensor(1)],
    "tolist": lambda: _vector().tolist(),
    "torch.nonzero": lambda: torch.nonzero(_vector()),
    "Tensor.nonzero": lambda: _vector().nonzero(),
    "torch.equal": lambda: torch.equal(_vector(), _vector()),
    "cpu": _meta_to_host(lambda t: t.cpu()),
    "to_cpu": _meta_to_host(lambda t: t.to("cpu")),
    "copy_to_host": _meta_to_host(lambda t: torch.empty(3).copy_(t)),
    "numpy": lambda: _vector().numpy(),
    "np.asarray": lambda: np.asarray(_vector()),
    "repr": lambda: repr(_vector()),
    "f-string": lambda: f"{_vector()}",
    # Reported once at the Python level although it also reaches aten._local_scalar_dense.
    "f-string_scalar": lambda: f"{_scalar():.2f}",
    "bool_mask_index": lambda: _vector()[_vector() > 0],
    "masked_select": lambda: _vector().masked_select(_vector() > 0),
    "unique": lambda: torch.unique(_vector()),
    "repeat_interleave": lambda: torch.repeat_interleave(_vector(), torch.tensor([1, 2, 1])),
}


def _ordinary_math() -> torch.Tensor:
    """Step-like tensor work that never needs values on the host."""
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(4, 2)
    out = torch.empty(3, 2)
    out.copy_(a @ b)
    rows = torch.tensor([2, 0])
    picked = out[rows] + out[1:]
    picked.add_(1.0)
    out[rows] = picked
    _ = torch.repeat_interleave(a, torch.tensor([1, 2, 1]), dim=0, output_size=4)
    return out.cpu()  # a CPU tensor to the CPU: no copy, no wait


@pytest.fixture
def error_checker() -> SyncChecker:
    return SyncChecker("error")


@pytest.fixture
def warn_checker() -> SyncChecker:
    return SyncChecker("warn")


@pytest.fixture(autouse=True)
def _stacks_restored() -> Iterator[None]:
    """Every test must leave the mode stacks as it found them."""
    before = _stack_lengths()
    yield
    assert _stack_lengths() == before


# --- environment ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "off"),
        ({SYNC_CHECK_ENV: ""}, "off"),
        ({SYNC_CHECK_ENV: "off"}, "off"),
        ({SYNC_CHECK_ENV: "warn"}, "warn"),
        ({SYNC_CHECK_ENV: "error"}, "error"),
        ({SYNC_CHECK_ENV: " WARN "}, "warn"),
        ({SYNC_CHECK_ENV: "Error\n"}, "error"),
        ({SYNC_CHECK_ENV: "  "}, "off"),
        ({"OTHER": "error"}, "off"),
    ],
)
def test_mode_from_env(environ: dict[str, str], expected: str) -> None:
    assert sync_check_mode_from_env(environ) == expected


def test_mode_from_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SYNC_CHECK_ENV, "error")
    assert sync_check_mode_from_env() == "error"
    assert SyncChecker.from_env().mode == "error"
    monkeypatch.delenv(SYNC_CHECK_ENV)
    assert sync_check_mode_from_env() == "off"


@pytest.mark.parametrize("bad", ["on", "1", "true", "warning", "err or"])
def test_bad_env_value_names_variable_value_and_choices(bad: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        sync_check_mode_from_env({SYNC_CHECK_ENV: bad})
    message = str(excinfo.value)
    assert SYNC_CHECK_ENV in message
    assert repr(bad) in message
    for allowed in ("off", "warn", "error"):
        assert allowed in message


def test_checker_validates_mode() -> None:
    assert SyncChecker(" Warn ").mode == "warn"
    assert not SyncChecker("off").enabled
    assert SyncChecker("error").enabled
    with pytest.raises(ValueError, match="expected one of"):
        SyncChecker("loud")


# --- flagged ops ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FLAGGED_OPS))
def test_flagged_op_raises_in_error_mode(name: str, error_checker: SyncChecker) -> None:
    op = FLAGGED_OPS[name]
    with pytest.raises(SyncCheckError, match="AsyncOutput.get_output"), error_checker.guard():
        op()
    assert error_checker.violations == 1


@pytest.mark.parametrize("name", list(FLAGGED_OPS))
def test_flagged_op_warns_logs_and_counts_in_warn_mode(
    name: str, warn_checker: SyncChecker, caplog: pytest.LogCaptureFixture
) -> None:
    op = FLAGGED_OPS[name]
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER_NAME),
        pytest.warns(SyncCheckWarning) as record,
        warn_checker.guard(),
    ):
        op()
    # Exactly one report per read: the inner ops of a reported op are not reported again.
    assert warn_checker.violations == 1
    assert len([w for w in record if issubclass(w.category, SyncCheckWarning)]) == 1
    logged = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert len(logged) == 1
    assert logged[0].levelno == logging.WARNING
    assert str(record[0].message) == logged[0].getMessage()


def test_planted_item_names_its_function_file_and_line(error_checker: SyncChecker) -> None:
    with pytest.raises(SyncCheckError) as excinfo, error_checker.guard():
        _planted_read(torch.tensor(1.5))
    message = str(excinfo.value)
    assert f"{PLANTED_FILE}:{PLANTED_LINE} _planted_read" in message
    assert "_local_scalar_dense" in message


def test_planted_item_warning_points_at_its_line(warn_checker: SyncChecker) -> None:
    with pytest.warns(SyncCheckWarning) as record, warn_checker.guard():
        assert _planted_read(torch.tensor(1.5)) == 1.5
    assert record[0].filename == PLANTED_FILE
    assert record[0].lineno == PLANTED_LINE
    assert f"{PLANTED_FILE}:{PLANTED_LINE} _planted_read" in str(record[0].message)


def test_warn_mode_counts_every_read(warn_checker: SyncChecker) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyncCheckWarning)
        with warn_checker.guard():
            for _ in range(3):
                _planted_read(torch.tensor(1.0))
            _vector().tolist()
    assert warn_checker.violations == 4


# --- what is not reported -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FLAGGED_OPS))
def test_flagged_op_inside_allow_is_not_reported(name: str, error_checker: SyncChecker) -> None:
    with error_checker.guard():
        with error_checker.allow():
            FLAGGED_OPS[name]()
        # Checking resumes once the legal wait is over.
        with pytest.raises(SyncCheckError):
            FLAGGED_OPS[name]()
    assert error_checker.violations == 1


@pytest.mark.parametrize("name", list(FLAGGED_OPS))
def test_flagged_op_outside_guard_is_not_reported(name: str, error_checker: SyncChecker) -> None:
    FLAGGED_OPS[name]()
    with error_checker.allow():
        FLAGGED_OPS[name]()
    assert error_checker.violations == 0


def test_ordinary_tensor_math_is_not_reported(error_checker: SyncChecker) -> None:
    with error_checker.guard():
        out = _ordinary_math()
    assert error_checker.violations == 0
    assert torch.equal(out, _ordinary_math())


def test_nested_allow_restores_outer_allow(error_checker: SyncChecker) -> None:
    with error_checker.guard(), error_checker.allow():
        with error_checker.allow():
            _planted_read(torch.tensor(1.0))
        _planted_read(torch.tensor(1.0))
    assert error_checker.violations == 0


def test_reads_on_other_threads_are_not_reported(error_checker: SyncChecker) -> None:
    results: list[float] = []
    with error_checker.guard():
        worker = threading.Thread(target=lambda: results.append(_planted_read(torch.tensor(2.0))))
        worker.start()
        worker.join()
    assert results == [2.0]
    assert error_checker.violations == 0


# --- guard mechanics ------------------------------------------------------------------------


def test_guard_pushes_one_mode_each_and_is_reentrant(error_checker: SyncChecker) -> None:
    dispatch, function = _stack_lengths()
    with error_checker.guard():
        assert _stack_lengths() == (dispatch + 1, function + 1)
        with error_checker.guard():
            assert _stack_lengths() == (dispatch + 1, function + 1)
        with pytest.raises(SyncCheckError):
            _planted_read(torch.tensor(1.0))
    assert _stack_lengths() == (dispatch, function)
    assert error_checker.violations == 1


def test_guard_unwinds_after_an_error(error_checker: SyncChecker) -> None:
    before = _stack_lengths()
    with pytest.raises(SyncCheckError), error_checker.guard():
        _planted_read(torch.tensor(1.0))
    assert _stack_lengths() == before
    # Outside the guard again: nothing is reported.
    _planted_read(torch.tensor(1.0))
    assert error_checker.violations == 1


def test_off_mode_reports_nothing_and_pushes_nothing() -> None:
    checker = SyncChecker("off")
    before = _stack_lengths()
    with checker.guard():
        assert _stack_lengths() == before
        for op in FLAGGED_OPS.values():
            op()
        checker.report_wait("worker pipe recv")
        with checker.allow():
            assert _stack_lengths() == before
    assert checker.violations == 0


# --- report_wait ----------------------------------------------------------------------------


def _wait_on_pipe(checker: SyncChecker) -> None:
    checker.report_wait("mp executor: recv on worker pipe")


def test_report_wait_in_error_mode_raises_with_what_and_caller(
    error_checker: SyncChecker,
) -> None:
    with pytest.raises(SyncCheckError) as excinfo, error_checker.guard():
        _wait_on_pipe(error_checker)
    message = str(excinfo.value)
    assert "mp executor: recv on worker pipe" in message
    assert f"{__file__}:" in message
    assert "_wait_on_pipe" in message
    assert error_checker.violations == 1


def test_report_wait_in_warn_mode_warns_and_counts(
    warn_checker: SyncChecker, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER_NAME),
        pytest.warns(SyncCheckWarning, match="recv on worker pipe"),
        warn_checker.guard(),
    ):
        _wait_on_pipe(warn_checker)
    assert warn_checker.violations == 1
    assert any("recv on worker pipe" in r.getMessage() for r in caplog.records)


def test_report_wait_ignored_outside_guard_and_inside_allow(error_checker: SyncChecker) -> None:
    _wait_on_pipe(error_checker)
    with error_checker.guard():
        with error_checker.allow():
            _wait_on_pipe(error_checker)
        with pytest.raises(SyncCheckError):
            _wait_on_pipe(error_checker)
    _wait_on_pipe(error_checker)
    assert error_checker.violations == 1


# --- CUDA sync debug mode -------------------------------------------------------------------


class _FakeCudaDebugMode:
    """Stands in for torch.cuda's sync-debug-mode functions on this CPU-only machine."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized
        self.mode: int | str = 0
        self.history: list[int | str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", self.set)

    def set(self, mode: int | str) -> None:
        self.mode = mode
        self.history.append(mode)


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_guard_sets_and_restores_cuda_sync_debug_mode(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeCudaDebugMode(initialized=True)
    fake.install(monkeypatch)
    checker = SyncChecker(mode)
    with checker.guard():
        assert fake.mode == mode
        with checker.allow():
            assert fake.mode == "default"
        assert fake.mode == mode
    assert fake.mode == 0
    assert fake.history == [mode, "default", mode, 0]


def test_guard_leaves_uninitialised_cuda_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCudaDebugMode(initialized=False)
    fake.install(monkeypatch)
    with SyncChecker("error").guard():
        pass
    with SyncChecker("off").guard():
        pass
    assert fake.history == []
