"""engine/executor/worker_start.py: the workers' set-up is its own step. A start that fails at
any rank stops every worker it started (the prestarted rank 0 included, rank 0 last) and closes
every buffer; the executor is built from started workers and starts nothing itself.

The worker processes are stand-ins here (no interpreter started): test_worker_start.py starts
real ones."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest
import torch
from test_worker_start import runner_spec

from baton.engine.executor import worker_process, worker_start
from baton.engine.executor.base import ExecutorError
from baton.engine.executor.multiproc import MultiprocExecutor
from baton.engine.loader import load_checkpoint
from baton.engine.worker.messages import Failed, Ready
from baton.engine.worker.shared_memory import SharedBuffer
from baton.engine.worker.worker_main import WorkerInit


class FakeWorker:
    """A ``WorkerProcess`` without a process: it answers ``answer`` to its init at once and
    records what it was handed and whether it was stopped."""

    def __init__(self, log: list[str], answer: object = None) -> None:
        self.conn, self._theirs = multiprocessing.Pipe()
        self._log = log
        self._answer = Ready() if answer is None else answer
        self.pid = 40000 + len(log)
        self.fds: list[int] = []
        self.stopped = False
        log.append(f"start {self.pid}")

    def hand_over(self, fds: list[int]) -> None:
        self.fds = list(fds)
        self._theirs.send(self._answer)  # the worker's answer to what follows

    def is_alive(self) -> bool:
        return not self.stopped

    def exit_description(self) -> str | None:
        return "exit code 0" if self.stopped else None

    def stop(self) -> None:
        if not self.stopped:
            self._log.append(f"stop {self.pid}")
        self.stopped = True


@pytest.fixture()
def tiny(tiny_model_dir: Path):
    return load_checkpoint(str(tiny_model_dir))


@pytest.fixture()
def buffers(monkeypatch) -> list[SharedBuffer]:
    """Every shared buffer the start makes (the ring's included)."""
    made: list[SharedBuffer] = []
    real = SharedBuffer.create.__func__  # type: ignore[attr-defined]

    def create(cls, nbytes: int, name: str) -> SharedBuffer:
        buf = real(cls, nbytes, name)
        made.append(buf)
        return buf

    monkeypatch.setattr(SharedBuffer, "create", classmethod(create))
    return made


def _workers(monkeypatch, log: list[str], answers: dict[int, object]) -> list[FakeWorker]:
    """Stand-ins for the fresh workers (not the prestarted one), the n-th one answering
    ``answers[n]`` (Ready if absent) or, for an exception, failing to start with it."""
    made: list[FakeWorker] = []

    def new() -> FakeWorker:
        answer = answers.get(len(made))
        if isinstance(answer, BaseException):
            raise answer
        made.append(FakeWorker(log, answer))
        return made[-1]

    monkeypatch.setattr(worker_start, "WorkerProcess", new)
    return made


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def test_a_rank_that_cannot_start_stops_the_prestarted_rank_0(tiny, buffers, monkeypatch):
    log: list[str] = []
    _workers(monkeypatch, log, {0: OSError("no more processes (test)")})
    early = FakeWorker(log)
    with pytest.raises(ExecutorError, match=r"cannot start the model worker process: no more"):
        worker_start.start_workers(runner_spec(tiny, 2), tiny.weights, prestarted=early)
    assert early.stopped and log == [f"start {early.pid}", f"stop {early.pid}"]
    # the step I/O buffer, the ring and both ranks' weights: every descriptor closed
    assert len(buffers) == 4 and all(buf.fd == -1 for buf in buffers)


def test_a_rank_that_fails_to_build_stops_every_rank_rank_0_last(tiny, buffers, monkeypatch):
    log: list[str] = []
    workers = _workers(monkeypatch, log, {1: Failed("Traceback: no model.norm (test)")})
    with pytest.raises(ExecutorError, match=r"failed to start: rank 1: \nTraceback: no model"):
        worker_start.start_workers(runner_spec(tiny, 2), tiny.weights)
    first, second = workers
    assert log == [
        f"start {first.pid}",
        f"start {second.pid}",
        f"stop {second.pid}",
        f"stop {first.pid}",
    ]
    assert all(buf.fd == -1 for buf in buffers)
    port = second._theirs.recv().store_port  # what rank 1 was told to meet at
    assert port > 0 and not _port_open(port)  # the store is gone with the start


def test_the_executor_is_built_from_started_workers_and_starts_nothing(tiny, buffers, monkeypatch):
    log: list[str] = []
    workers = _workers(monkeypatch, log, {})
    started = worker_start.start_workers(runner_spec(tiny, 2), tiny.weights)
    first, second = workers
    assert started.workers == (first, second)
    assert log == [f"start {first.pid}", f"start {second.pid}"]  # ready: nothing stopped
    assert all(buf.fd == -1 for buf in buffers)  # the workers hold their own descriptors
    init = second._theirs.recv()
    assert isinstance(init, WorkerInit) and init.rank == 1 and len(second.fds) == 3
    assert bool((started.bitmasks == -1).all())

    def no_process(*args, **kwargs):
        raise AssertionError("the executor started a worker")

    monkeypatch.setattr(worker_start, "WorkerProcess", no_process)
    monkeypatch.setattr(worker_process.subprocess, "Popen", no_process)
    executor = MultiprocExecutor(started)
    assert executor.worker_pids == (first.pid, second.pid)
    assert log == [f"start {first.pid}", f"start {second.pid}"]
    assert executor.bitmask_buffer().data_ptr() == started.bitmasks[0].data_ptr()
    executor.shutdown()
    assert log[2:] == [f"stop {second.pid}", f"stop {first.pid}"]


def test_started_workers_need_one_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        worker_start.StartedWorkers((), torch.zeros(1), torch.zeros(1))
