"""Runs queued compiles on worker processes: who starts when, time limits, kills, results.

A dispatcher thread owns the workers (``pool``). It starts a queued compile when
fewer than ``workers`` compiles have been running for less than ``slow_after_s`` (and at
most ``max_workers`` processes exist), kills a worker whose compile passes the time limit,
and hands each result to loader threads that rebuild it in the engine process. Only the
job's future reports the outcome; the caller decides what a failure means.

The time limit counts the compile's own running time: the CPU time its worker process uses
(compile workers run one thread each), so neither the wait in the queue nor a machine
busy with other work makes a compile fail that would pass alone. A wall-clock backstop of
``WALL_LIMIT_FACTOR`` times the limit ends a worker that makes no progress at all.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for

from baton.grammar.backend import BackendRecipe, CompiledGrammar, GrammarError
from baton.grammar.compile.pool import CompileWorker, WorkerStartError, Zygote
from baton.grammar.spec import StructuredOutputsParams
from baton.grammar.vocab import Vocab

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the compile-time histogram's buckets.
COMPILE_SECONDS_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
WALL_LIMIT_FACTOR = 10.0
_RESTART_AFTER_S = 5.0  # a failed worker start is retried no sooner
_MIN_CHECK_S = 0.02
_PACE_AFTER_S = 0.5  # running time over wall time is measured after this long
_MIN_PACE = 0.1
_RETRY_MARGIN_S = 0.5
# The cores a compile worker may run on (it inherits this process's affinity mask), not the
# machine's: the earliest a compile can use up its CPU-time limit.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_MAX_WAIT_S = 1.0  # the dispatcher looks around at least this often
_COUNTERS = (
    "grammar_compiles",
    "grammar_compile_errors",
    "grammar_compile_timeouts",
    "grammar_compile_worker_starts",
    "grammar_compile_worker_kills",
    "grammar_compile_worker_deaths",
)


class CompileTimeout(GrammarError):
    """A compile ran longer than the time limit; its worker was stopped.

    ``over_limit`` is True when it used up its running time (the same spec would again),
    False when the wall-clock backstop stopped it (a starved worker: it might not).
    """

    def __init__(self, message: str, over_limit: bool = True) -> None:
        super().__init__(message)
        self.over_limit = over_limit


class SpecRejected(GrammarError):
    """The backend refused the spec itself (its syntax, a feature it lacks, an invalid
    schema): the caller's error, unlike a crash, a memory failure or a shutdown."""


@dataclass(frozen=True)
class CompilePoolConfig:
    """How many compiles run, queue and use how much memory.

    Attributes:
        workers: compiles that run at once (those past ``slow_after_s`` excepted).
        max_workers: worker processes at most, slow compiles included.
        max_queued: specs that may wait for a worker; one more is refused as busy.
        slow_after_s: a compile running this long stops counting against ``workers``.
        memory_limit_bytes: address space a worker may add to the template process's
            (None: no cap); a compile needing more fails with an out-of-memory error.
        retire_private_bytes: a worker whose private memory exceeds this after a compile
            exits instead of serving the next one.
        load_threads: engine-side threads that rebuild the workers' results.

    Raises:
        ValueError: naming the field out of range.
    """

    workers: int = 2
    max_workers: int = 6
    max_queued: int = 64
    slow_after_s: float = 0.1
    memory_limit_bytes: int | None = 4 << 30
    retire_private_bytes: int = 512 << 20
    load_threads: int = 2

    def __post_init__(self) -> None:
        for name in ("workers", "max_queued", "load_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_workers, int) or self.max_workers < self.workers:
            raise ValueError(f"max_workers must be an int >= workers, got {self.max_workers!r}")
        if not self.slow_after_s > 0:
            raise ValueError(f"slow_after_s must be > 0, got {self.slow_after_s!r}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1 << 20:
            raise ValueError(f"memory_limit_bytes must be >= 1 MiB, got {self.memory_limit_bytes}")


@dataclass(frozen=True)
class Compiled:
    """A compile's result: the engine's grammar, the compile's own seconds, and the size of
    the compiled form the worker sent (outlines-core's index; xgrammar's and llguidance's
    grammar text), the measure of what caching it costs."""

    grammar: CompiledGrammar
    seconds: float
    nbytes: int = 0


@dataclass(eq=False)
class CompileJob:
    """One compile of ``spec`` on backend ``name``; ``future`` gets its outcome."""

    key: tuple[object, ...]
    name: str
    spec: StructuredOutputsParams
    future: Future[Compiled] = field(default_factory=Future)
    started_at: float = 0.0
    deadline: float = 0.0  # the wall-clock backstop
    cpu_start: float | None = None
    used_s: float = 0.0  # running time so far (CPU time, or wall time where unknown)


Rebuild = Callable[[str, StructuredOutputsParams, bytes], CompiledGrammar]


class CompileDispatcher:
    """Queues compile jobs and runs them on worker processes (see the module docstring).

    Args:
        recipes: the backends the workers build.
        vocab: the vocabulary, read lazily (sent once to the worker template process).
        vocab_size: the model's vocabulary size.
        timeout_s: time limit of a compile's own running time (its worker's CPU time).
        config: worker counts, queue bound, memory cap.
        rebuild: (backend name, spec, worker bytes) -> the engine's grammar.
        on_failed: called with each job that failed and its error, before its future is set
            (outside every lock of the dispatcher).
    """

    def __init__(
        self,
        recipes: Sequence[BackendRecipe],
        vocab: Callable[[], Vocab],
        vocab_size: int,
        timeout_s: float,
        config: CompilePoolConfig,
        rebuild: Rebuild,
        on_failed: Callable[[CompileJob, BaseException], None],
    ) -> None:
        self._recipes = tuple(r.for_workers() for r in recipes)
        self._vocab = vocab
        self._vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.config = config
        self._rebuild = rebuild
        self._on_failed = on_failed
        self._lock = threading.Lock()
        self._queue: deque[CompileJob] = deque()
        self._running: dict[CompileWorker, CompileJob] = {}
        self._idle: list[CompileWorker] = []
        self._loading: set[CompileJob] = set()
        self._ids = itertools.count()
        self._zygote: Zygote | None = None
        self._start_failed_at: float | None = None
        self._loader = ThreadPoolExecutor(config.load_threads, "baton-grammar-load")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._histogram = [0] * len(COMPILE_SECONDS_BUCKETS)
        self._seconds_sum = 0.0
        self._seconds_count = 0

    # ---------------------------------------------------------------- intake
    def queue_length(self) -> int:
        """Jobs waiting for a worker."""
        with self._lock:
            return len(self._queue)

    def enqueue(self, job: CompileJob) -> None:
        """Queues ``job`` (the caller enforces the queue bound).

        Raises:
            RuntimeError: the dispatcher has been shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile service has been shut down")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="baton-grammar-dispatch", daemon=True
                )
                self._thread.start()
        self._wake()

    def retry_after_s(self) -> float:
        """Seconds after which a queue slot should have opened: when the first of the
        compiles running now reaches its limit, at the pace it has been running so far,
        with a margin (at least 1 s)."""
        now = time.monotonic()
        waits = []
        with self._lock:
            running = list(self._running.items())
        for worker, job in running:
            # Read now: the dispatcher refreshes ``used_s`` only when it wakes (up to a
            # second apart), and a stale value would make the pace look near zero.
            used = self._used_s(worker, job, now)
            elapsed = now - job.started_at
            pace = used / elapsed if elapsed >= _PACE_AFTER_S else 1.0
            pace = min(1.0, max(_MIN_PACE, pace))
            waits.append(max(0.0, self.timeout_s - used) / pace)
        # A busy machine's pace drifts: a quarter more, and half a second, to be safe.
        return max(1.0, 1.25 * min(waits, default=1.0) + _RETRY_MARGIN_S)

    # ------------------------------------------------------------ the thread
    def _wake(self) -> None:
        # A full socket means a wake-up is pending already; a closed one, that we are closing.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        try:
            while not self._closed:
                self._start_jobs()
                with self._lock:
                    conns = [self._wake_r, *(w.conn for w in self._running)]
                for obj in wait_for(conns, self._next_wake()):
                    if obj is self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        self._receive(obj)
                self._expire()
        except Exception:  # noqa: BLE001 - never leave requests waiting forever
            logger.exception("grammar compile dispatcher failed")
            self._fail_all("the grammar compile dispatcher failed (see the log)")
        finally:
            if self._closed:  # a worker or the zygote started while shutting down ends here
                self._fail_all("the grammar compile service was shut down")
                if self._zygote is not None:
                    self._zygote.close()

    def _start_jobs(self) -> None:
        cfg = self.config
        while True:
            now = time.monotonic()
            with self._lock:
                if not self._queue or self._closed:
                    return
                young = sum(now - j.started_at < cfg.slow_after_s for j in self._running.values())
                if young >= cfg.workers:
                    return
                if not self._idle and len(self._running) >= cfg.max_workers:
                    return
                job = self._queue.popleft()
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                try:
                    worker = self._spawn()
                except WorkerStartError as exc:
                    self._fail(job, GrammarError(f"cannot compile: {exc}"))
                    continue
                if self._closed:
                    worker.kill()
                    self._fail(job, GrammarError("the grammar compile service was shut down"))
                    return
            job.started_at = time.monotonic()
            job.deadline = job.started_at + WALL_LIMIT_FACTOR * self.timeout_s
            job.cpu_start = worker.cpu_seconds()
            job.used_s = 0.0
            try:
                worker.send((next(self._ids), job.name, job.spec))
            except (OSError, EOFError, ValueError):
                worker.kill()  # it ended while idle: the job goes to another worker
                job.started_at = job.deadline = 0.0
                with self._lock:
                    self._queue.appendleft(job)
                continue
            with self._lock:
                self._running[worker] = job
            logger.debug("started a %s compile on worker %d", job.name, worker.pid)

    def _spawn(self) -> CompileWorker:
        zygote = self._zygote
        if zygote is None or zygote.failure is not None:
            failed = self._start_failed_at
            if zygote is not None and failed is not None:
                if time.monotonic() - failed < _RESTART_AFTER_S:
                    raise WorkerStartError(zygote.failure or "the compile workers cannot start")
                zygote.close()
            zygote = self._zygote = Zygote(
                self._recipes, self._vocab(), self._vocab_size, self.config.memory_limit_bytes
            )
        try:
            worker = zygote.fork()
        except WorkerStartError as exc:
            self._start_failed_at = time.monotonic()
            if not self._closed:  # shutting down closes the zygote under a start: no error
                logger.error("grammar compile workers cannot start: %s", exc)
            raise
        self._start_failed_at = None
        with self._lock:
            self._counts["grammar_compile_worker_starts"] += 1
        return worker

    def _next_wake(self) -> float:
        now = time.monotonic()
        times = [now + _MAX_WAIT_S]
        with self._lock:
            waiting = bool(self._queue)
            for job in self._running.values():
                times.append(job.deadline)
                # The earliest the limit can be reached, with every core working for it.
                times.append(now + max(_MIN_CHECK_S, (self.timeout_s - job.used_s) / _CORES))
                if waiting and now - job.started_at < self.config.slow_after_s:
                    times.append(job.started_at + self.config.slow_after_s)
        return max(0.0, min(times) - now)

    def _receive(self, conn: object) -> None:
        with self._lock:
            worker = next((w for w in self._running if w.conn is conn), None)
        if worker is None:
            return
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            with self._lock:
                job = self._running.pop(worker)
                self._counts["grammar_compile_worker_deaths"] += 1
            worker.kill()
            logger.warning("a grammar compile worker (pid %d) ended while compiling", worker.pid)
            self._observe(time.monotonic() - job.started_at)
            self._fail(
                job,
                GrammarError(
                    "the compile worker ended while compiling this spec: it crashed, or it "
                    f"needed more memory than {self._memory_cap()} (an allocation failure "
                    "ends some backends)"
                ),
            )
            return
        status, _, body, seconds, private = msg[:5]
        memory = status == "error" and msg[5] == "memory"
        rejected = status == "error" and msg[5] == "compile"
        with self._lock:
            job = self._running.pop(worker)
            keep = (
                not memory
                and private <= self.config.retire_private_bytes
                and len(self._idle) < self.config.workers
                and not self._closed
            )
            if keep:
                self._idle.append(worker)
            if status == "ok":
                self._loading.add(job)
            else:
                self._counts["grammar_compile_errors"] += 1
        if not keep:
            worker.close()
        if status == "ok":
            self._loader.submit(self._load, job, body, seconds)
            return
        self._observe(seconds)
        if memory:
            body = f"{body} (compiling it needs more memory than {self._memory_cap()})"
        self._fail(job, SpecRejected(str(body)) if rejected else GrammarError(str(body)))

    def _memory_cap(self) -> str:
        limit = self.config.memory_limit_bytes
        if limit is None:
            return "the system has"
        return f"the limit of {limit / (1 << 30):.3g} GiB per compile"

    def _load(self, job: CompileJob, payload: bytes, seconds: float) -> None:
        t0 = time.perf_counter()
        try:
            grammar = self._rebuild(job.name, job.spec, payload)
        except Exception as exc:  # noqa: BLE001 - a backend bug fails this spec only
            logger.exception("rebuilding a compiled %s grammar failed", job.name)
            self._fail(job, GrammarError(f"rebuilding the compiled grammar failed: {exc}"))
            return
        total = seconds + time.perf_counter() - t0
        self._observe(total)
        with self._lock:
            self._counts["grammar_compiles"] += 1
            self._loading.discard(job)
        with contextlib.suppress(InvalidStateError):  # failed by shutdown meanwhile
            job.future.set_result(Compiled(grammar, total, len(payload)))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            running = list(self._running.items())
        late = []
        for worker, job in running:
            job.used_s = self._used_s(worker, job, now)
            if job.used_s >= self.timeout_s or now >= job.deadline:
                late.append((worker, job))
        with self._lock:
            late = [(w, j) for w, j in late if self._running.get(w) is j]
            for worker, _ in late:
                del self._running[worker]
                self._counts["grammar_compile_timeouts"] += 1
                self._counts["grammar_compile_worker_kills"] += 1
        for worker, job in late:
            worker.kill()
            wall = now - job.started_at
            logger.warning(
                "a %s compile passed its limit of %g s (%.1f s of running time in %.1f s); "
                "its worker (pid %d) was killed",
                job.name,
                self.timeout_s,
                job.used_s,
                wall,
                worker.pid,
            )
            self._observe(job.used_s)
            over_limit = now < job.deadline
            self._fail(
                job,
                CompileTimeout(
                    f"grammar compilation timed out: it ran longer than the limit of "
                    f"{self.timeout_s:g} s, and its worker was stopped"
                    if over_limit
                    else f"grammar compilation timed out: it made too little progress in "
                    f"{wall:.0f} s, and its worker was stopped",
                    over_limit,
                ),
            )

    @staticmethod
    def _used_s(worker: CompileWorker, job: CompileJob, now: float) -> float:
        """``job``'s running time so far: its worker's CPU time, or wall time where unknown."""
        cpu = worker.cpu_seconds()
        if cpu is None or job.cpu_start is None:
            return now - job.started_at
        return cpu - job.cpu_start

    def _observe(self, seconds: float) -> None:
        with self._lock:
            self._seconds_sum += seconds
            self._seconds_count += 1
            i = bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)
            if i < len(self._histogram):
                self._histogram[i] += 1

    def _fail(self, job: CompileJob, error: BaseException) -> None:
        with self._lock:
            self._loading.discard(job)
        self._on_failed(job, error)
        with contextlib.suppress(InvalidStateError):  # already resolved
            job.future.set_exception(error)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            jobs = [*self._queue, *self._running.values(), *self._loading]
            workers = [*self._running, *self._idle]
            self._queue.clear()
            self._running.clear()
            self._idle.clear()
        for worker in workers:
            worker.kill()
        for job in jobs:
            self._fail(job, GrammarError(message))

    # ----------------------------------------------------------------- state
    def stats(self) -> dict[str, float | int]:
        """Counters, gauges and the compile-time histogram (see ``CompileService.stats``)."""
        with self._lock:
            out: dict[str, float | int] = dict(self._counts)
            out.update(
                grammar_compile_queue_length=len(self._queue),
                grammar_compile_queue_limit=self.config.max_queued,
                grammar_compile_running=len(self._running),
                grammar_compile_workers=len(self._running) + len(self._idle),
                grammar_compile_seconds_sum=self._seconds_sum,
                grammar_compile_seconds_count=self._seconds_count,
            )
            cumulative = itertools.accumulate(self._histogram)
            for bound, total in zip(COMPILE_SECONDS_BUCKETS, cumulative, strict=True):
                out[f"grammar_compile_seconds_le_{bound:g}"] = total
        return out

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes (running and idle)."""
        with self._lock:
            return [w.pid for w in (*self._running, *self._idle)]

    def shutdown(self) -> None:
        """Stops the thread and every worker process; pending jobs fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        self._fail_all("the grammar compile service was shut down")
        if self._zygote is not None:
            self._zygote.close()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._wake_r.close()
        self._wake_w.close()


__all__ = [
    "COMPILE_SECONDS_BUCKETS",
    "CompileDispatcher",
    "CompileJob",
    "CompilePoolConfig",
    "CompileTimeout",
    "SpecRejected",
    "Compiled",
]
