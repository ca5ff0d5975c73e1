"""The grammar benchmark's worker processes: each builds the backends once, then takes tasks
(one schema on one backend) and reports back; a crash, hang or out-of-memory ends only its task,
and the pool goes on with a fresh worker.

Workers are forked from multiprocessing's fork server, which imports torch, the worker code and
the grammar backends once (``PRELOAD``): a worker that replaces a crashed or killed one starts
in well under a second instead of the 2-5 s of a fresh interpreter, which on schemas that crash
or hang a backend was most of the run. Where the fork server is not available, workers are
spawned.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any, Literal

from baton.bench.grammars.grammar_worker import Task, WorkerConfig, worker_main

STARTUP_TIMEOUT_S = 300.0
"""A worker that has not built its backends by then stops the run."""

PRELOAD = (
    "baton.bench.grammars.grammar_worker",
    "baton.grammar.xgrammar.backend",
    "baton.grammar.outlines.backend",
    "baton.grammar.guidance.backend",
)
"""Modules the fork server imports once for every worker (one that fails to import is skipped
there and imported by the workers that need it)."""

Status = Literal["ok", "compile_error", "timeout", "crash", "oom"]


# ------------------------------------------------------------------------------ the workers


def worker_context() -> BaseContext:
    """The multiprocessing context workers start from: the fork server with ``PRELOAD`` where
    the platform has one, else spawn. The fork server is started on first use and lives as
    long as this process (workers see the environment it had then); its preload list is set
    only if no fork server is running yet."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


@dataclass
class TaskRecord:
    """What came back for one task so far.

    Attributes:
        task: the schema and backend.
        status: None while running, then how it ended.
        error_kind: for a compile error: "invalid", "unsupported", "compile" or "oom".
        error: why it failed (the compile error, time-out or crash), None when ok.
        compile_reported: the worker has reported the compile's outcome (later failures are
            during a test's walk).
        compiled: the schema compiled.
        compile_s: seconds of the backend's check and compile.
        instances: the ``InstanceOutcome``s (as dicts) of the tests walked so far.
    """

    task: Task
    status: Status | None = None
    error_kind: str | None = None
    error: str | None = None
    compile_reported: bool = False
    compiled: bool = False
    compile_s: float | None = None
    instances: list[dict[str, Any]] = field(default_factory=list)


def _death_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = {"SIGKILL": " (out of memory?)", "SIGABRT": " (abort; a failed allocation?)"}
        return f"was killed by {name}{hint.get(name, '')}"
    return f"exited with code {exitcode}"


class _Worker:
    """One worker process and the task it is serving."""

    def __init__(self, ctx: BaseContext, config: WorkerConfig) -> None:
        parent, child = ctx.Pipe()
        self.process = ctx.Process(  # type: ignore[attr-defined]
            target=worker_main, args=(child, config), name="baton-grammar-bench", daemon=True
        )
        self.process.start()
        child.close()  # so that the parent sees EOF when the worker dies
        self.conn: Connection = parent
        self.state: Literal["starting", "idle", "busy", "dead"] = "starting"
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self.record: TaskRecord | None = None

    def start(self, task: Task, timeout_s: float) -> None:
        self.record = TaskRecord(task)
        self.conn.send(task)
        self.state = "busy"
        self.deadline = time.monotonic() + timeout_s

    def receive(self, timeout_s: float) -> TaskRecord | None:
        """Reads one message; returns the record once its task is over.

        Raises:
            RuntimeError: the worker failed while starting.
        """
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            return self._died()
        kind = message[0]
        if self.state == "starting":
            if kind == "fatal":
                self.close()
                raise RuntimeError(
                    f"a benchmark worker could not build its backends:\n{message[1]}"
                )
            self.state = "idle"
            return None
        record = self.record
        assert record is not None
        self.deadline = time.monotonic() + timeout_s
        if kind == "compiled":
            outcome = message[1]
            record.compile_reported = True
            record.compiled = outcome["ok"]
            record.compile_s = outcome["compile_s"]
            record.error_kind = outcome["error_kind"]
            record.error = outcome["error"]
        elif kind == "instance":
            record.instances.append(message[1])
        else:  # "done"
            if record.compiled:
                record.status = "ok"
            else:
                record.status = "oom" if record.error_kind == "oom" else "compile_error"
            self.state = "idle"
            self.record = None
            return record
        return None

    def _phase(self, record: TaskRecord) -> str:
        if not record.compile_reported:
            return "compile"
        tests = record.task.case.tests
        index = len(record.instances)
        description = tests[index].description if index < len(tests) else "?"
        return f"test {index} ({description!r})"

    def _died(self) -> TaskRecord:
        self.process.join(timeout=5)
        reason = _death_reason(self.process.exitcode)
        self.close()
        if self.record is None:
            raise RuntimeError(f"a benchmark worker {reason} while starting")
        record, self.record = self.record, None
        record.status = "crash"
        record.error_kind = None
        record.error = f"the worker {reason} during {self._phase(record)}"
        return record

    def expire(self, timeout_s: float) -> TaskRecord:
        """Kills the worker at its deadline; returns the timed-out record.

        Raises:
            RuntimeError: the worker had not started by its deadline.
        """
        self.close()
        if self.record is None:
            raise RuntimeError(f"a benchmark worker did not start within {STARTUP_TIMEOUT_S} s")
        record, self.record = self.record, None
        record.status = "timeout"
        record.error_kind = None
        record.error = f"{self._phase(record)} took longer than {timeout_s:g} s"
        return record

    def close(self) -> None:
        """Stops the process (politely when idle) and closes the pipe."""
        if self.state == "dead":
            return
        if self.state == "idle" and self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()
        self.state = "dead"


def run_tasks(
    tasks: Sequence[Task],
    config: WorkerConfig,
    timeout_s: float,
    jobs: int = 1,
    progress: bool = True,
) -> list[TaskRecord]:
    """Runs ``tasks`` on ``jobs`` worker processes (``worker_context``), replacing a worker
    that crashed or was killed at its deadline; returns one record per task, in task order.

    Raises:
        RuntimeError: a worker could not start (bad backend factory, or it died while starting).
    """
    from tqdm import tqdm

    ctx = worker_context()
    pending = deque(tasks)
    done: list[TaskRecord] = []
    workers = [_Worker(ctx, config) for _ in range(min(jobs, len(tasks)))]
    bar = tqdm(total=len(tasks), unit="task", file=sys.stderr, disable=not progress)
    try:
        while pending or any(w.state == "busy" for w in workers):
            for i, worker in enumerate(workers):
                if worker.state == "idle" and not worker.process.is_alive():
                    worker.close()
                if worker.state == "dead" and pending:
                    workers[i] = worker = _Worker(ctx, config)
                if worker.state == "idle" and pending:
                    worker.start(pending.popleft(), timeout_s)
            waiting = [w for w in workers if w.state in ("starting", "busy")]
            wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            ready = wait([w.conn for w in waiting], timeout=wait_s)
            for worker in waiting:
                if worker.conn in ready:
                    finished = worker.receive(timeout_s)
                elif time.monotonic() >= worker.deadline:
                    finished = worker.expire(timeout_s)
                else:
                    continue
                if finished is not None:
                    done.append(finished)
                    bar.set_postfix_str(f"{finished.task.backend} {finished.task.case.id}"[:60])
                    bar.update(1)
    finally:
        bar.close()
        for worker in workers:
            worker.close()
    order = {id(task): i for i, task in enumerate(tasks)}
    return sorted(done, key=lambda r: order[id(r.task)])
