"""Compiles grammars in worker processes that can be stopped, behind an LRU cache and a
bounded queue.

The engine submits a spec and polls the returned handle once per step; a request whose
grammar is still compiling waits without holding up anyone.

* One compile serves every request for the same spec: a cache hit or a spec already in
  flight never queues. A new spec queues; when ``max_queued`` specs already wait,
  ``submit`` raises ``CompileQueueFull`` (the caller waits, or answers "busy") instead of
  accepting work that would fail later.
* ``dispatcher`` runs the queue on worker processes (``pool``): the time
  limit bounds a compile's own running time (its worker's CPU time), never its wait in the
  queue; a worker that passes it is killed and replaced, and only that spec's requests
  fail; a memory cap
  turns a schema that would exhaust the machine into an error; a few slow or hostile specs
  never block the ones behind them.
* A worker sends back bytes that the engine's own backend rebuilds (``export_compiled`` /
  ``import_compiled``); the result is cached in the engine process.
* A failure that would repeat (the backend refused the spec, or its compile used up the
  time limit) is cached too: the next request for that spec falls back (or fails) at once
  instead of paying for the same failed compile, and a hostile spec sent again costs
  nothing. Crashes, memory failures and wall-clock stops are not kept: those compile again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from baton.grammar.backend import BackendRecipe, CompiledGrammar, GrammarBackend, GrammarError
from baton.grammar.compile.dispatcher import (
    COMPILE_SECONDS_BUCKETS,
    Compiled,
    CompileDispatcher,
    CompileJob,
    CompilePoolConfig,
    CompileTimeout,
    SpecRejected,
)
from baton.grammar.spec import AUTO_ORDER, StructuredOutputsParams, allowed_backends
from baton.grammar.vocab import Vocab, build_vocab

logger = logging.getLogger(__name__)

# Preference order of "auto".
_CANDIDATES_CACHE_SIZE = 1024


class CompileQueueFull(RuntimeError):
    """Too many specs wait for a compile worker; nothing was queued.

    Attributes:
        retry_after_s: seconds after which a queue slot should have opened: the first
            compile running now reaches its limit by then at its present pace (with a margin).
    """

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class CompileResult:
    """The outcome of one compile request.

    Attributes:
        grammar: the compiled grammar, or None on failure.
        backend: the backend that served it (or last tried).
        fallback_reason: why the preferred backend was not used, if it was not.
        error: the failure message (compile error or time-out), if any.
        seconds: the compile's own time (worker plus rebuild; 0 when it was cached or
            another request's compile served it).
        cache_hit: served from the cache or by a compile already in flight.
        spec_error: the failure is the spec's own: every backend tried refused it, or its
            compile ran past the time limit (not a crash, memory failure or shutdown).
    """

    grammar: CompiledGrammar | None
    backend: str
    fallback_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0
    cache_hit: bool = False
    spec_error: bool = False


class CompileHandle:
    """A pending compile: ``result()`` is None until it is done.

    With several candidate backends ("auto"), a compile error on one moves on to the next
    (the reasons are kept in ``fallback_reason``); a time-out ends the chain.
    """

    def __init__(
        self,
        service: CompileService | None,
        spec: StructuredOutputsParams,
        names: Sequence[str],
        fallback: str | None,
        future: Future[Compiled],
        hit: bool,
    ) -> None:
        self._service = service
        self._spec = spec
        self._names = list(names)
        self._fallback = fallback
        self._future = future
        self._hit = hit
        self._index = 0
        self._errors: list[str] = []
        self._spec_errors = True  # every failure so far was the spec's own
        self._done: CompileResult | None = None

    def result(self) -> CompileResult | None:
        """The result when ready (a failed one has ``error`` set); None while compiling."""
        while self._done is None:
            if not self._future.done():
                return None
            name = self._names[self._index]
            exc = self._future.exception()
            if exc is None:
                compiled = self._future.result()
                reason = "; ".join(filter(None, [self._fallback, *self._errors])) or None
                seconds = 0.0 if self._hit else compiled.seconds
                self._done = CompileResult(compiled.grammar, name, reason, None, seconds, self._hit)
                break
            if self._service is None:  # refused before any compile: no backend takes it
                self._done = CompileResult(None, name, None, str(exc), spec_error=True)
                break
            self._errors.append(f"{name}: {exc}")
            self._spec_errors &= isinstance(exc, (SpecRejected, CompileTimeout))
            if self._index + 1 >= len(self._names) or isinstance(exc, CompileTimeout):
                self._done = CompileResult(
                    None,
                    name,
                    self._fallback,
                    "; ".join(self._errors),
                    spec_error=self._spec_errors,
                )
                break
            self._index += 1
            # Already admitted: the fallback compile does not count against the queue bound.
            self._future, self._hit = self._service._request(
                self._names[self._index], self._spec, bounded=False
            )
        return self._done


class CompileService:
    """Chooses a backend per spec and compiles it in killable worker processes.

    Args:
        recipes: how to build each backend (name -> recipe); the engine's copy is built at
            first use, the workers' once per worker template process.
        tokenizer: the model's tokenizer (or a ``Vocab``); its vocabulary is read once.
        vocab_size: the model's vocabulary size.
        timeout_s: time limit of one compile's own running time (its worker's CPU time; not
            its wait in the queue).
        cache_size: compiled grammars kept in the engine process.
        cache_bytes: and their total size at most (``Compiled.nbytes``): an outlines-core
            index is up to tens of MB, so a count alone let a burst of distinct schemas hold
            gigabytes. The least recently used go first; one bigger than the whole budget
            serves its requests but is not kept.
        pool: worker counts, queue bound and memory cap.

    Worker processes start at the first compile, not here. ``shutdown`` stops them.

    Raises:
        ValueError: a bad limit or size.
    """

    def __init__(
        self,
        recipes: Mapping[str, BackendRecipe],
        tokenizer: object,
        vocab_size: int,
        timeout_s: float = 10.0,
        cache_size: int = 256,
        pool: CompilePoolConfig | None = None,
        cache_bytes: int = 1 << 30,
    ) -> None:
        if timeout_s <= 0 or cache_size < 1 or cache_bytes < 1:
            raise ValueError("timeout_s must be > 0, cache_size >= 1 and cache_bytes >= 1")
        self._recipes = dict(recipes)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocab: Vocab | None = None
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self.timeout_s = timeout_s
        self.pool = pool or CompilePoolConfig()
        self._cache: OrderedDict[tuple[object, ...], Future[Compiled]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        # Sizes of the cached compiles that are done; in-flight ones count 0 until then.
        self._sizes: dict[tuple[object, ...], int] = {}
        self._cached_bytes = 0
        self._candidates: OrderedDict[tuple[object, ...], tuple[list[str], dict[str, str]]]
        self._candidates = OrderedDict()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            (
                "grammar_cache_hits",
                "grammar_cache_misses",
                "grammar_compile_joined",
                "grammar_compile_rejected",
            ),
            0,
        )
        self._dispatcher = CompileDispatcher(
            list(self._recipes.values()),
            self.vocab,
            vocab_size,
            timeout_s,
            self.pool,
            rebuild=lambda name, spec, data: self.backend(name).import_compiled(spec, data),
            on_failed=self._forget,
        )

    # ------------------------------------------------------------- backends
    def vocab(self) -> Vocab:
        """The vocabulary, read from the tokenizer at first use."""
        with self._backend_lock:
            if self._vocab is None:
                self._vocab = build_vocab(self._tokenizer)  # type: ignore[arg-type]
            return self._vocab

    def backend(self, name: str) -> GrammarBackend:
        """The engine's backend called ``name``, built on first use.

        Raises:
            ValueError: no backend has that name.
        """
        if name not in self._recipes:
            raise ValueError(f"unknown structured-output backend {name!r}")
        vocab = self.vocab()
        with self._backend_lock:
            if name not in self._backends:
                self._backends[name] = self._recipes[name].build(vocab, self._vocab_size)
            return self._backends[name]

    def candidates(self, spec: StructuredOutputsParams) -> tuple[list[str], dict[str, str]]:
        """Backends that can take ``spec`` in preference order, and why the others cannot."""
        ckey = (spec.backend, spec.allow_unenforced, *self._spec_key(spec))
        with self._lock:
            found = self._candidates.get(ckey)
            if found is not None:
                self._candidates.move_to_end(ckey)
                return list(found[0]), dict(found[1])
        names = list(allowed_backends(spec.backend))
        ok, reasons = [], {}
        for name in names:
            if name not in self._recipes:
                reasons[name] = "not available"
                continue
            reason = self.backend(name).unsupported_reason(spec)
            if reason is None:
                ok.append(name)
            else:
                reasons[name] = reason
        with self._lock:
            self._candidates[ckey] = (ok, reasons)
            while len(self._candidates) > _CANDIDATES_CACHE_SIZE:
                self._candidates.popitem(last=False)
        return list(ok), dict(reasons)

    # ----------------------------------------------------------- submission
    def has_room(self, spec: StructuredOutputsParams) -> bool:
        """False when ``submit(spec)`` would have to queue a new compile and the queue is full."""
        names, _ = self.candidates(spec)
        if not names:
            return True  # fails at once, never queues
        key = self._key(names[0], spec)
        with self._lock:
            if key in self._cache:
                return True
        return self._dispatcher.queue_length() < self.pool.max_queued

    def refuse(self) -> CompileQueueFull:
        """Counts a request refused because the queue is full; returns the error to raise."""
        with self._lock:
            self._counts["grammar_compile_rejected"] += 1
        return CompileQueueFull(
            f"{self.pool.max_queued} grammars already wait for a compile worker",
            self._dispatcher.retry_after_s(),
        )

    def retry_after_s(self) -> float:
        """Seconds after which a queue slot will surely have opened: when the first of the
        compiles running now reaches its time limit (at least 1 s)."""
        return self._dispatcher.retry_after_s()

    def submit(self, spec: StructuredOutputsParams) -> CompileHandle:
        """Starts compiling ``spec`` (or finds it cached or in flight); never blocks on a compile.

        Raises:
            CompileQueueFull: a new compile is needed and ``max_queued`` specs already wait.
        """
        names, reasons = self.candidates(spec)
        if not names:
            detail = "; ".join(f"{n}: {r}" for n, r in reasons.items())
            failed: Future[Compiled] = Future()
            failed.set_exception(GrammarError(f"no backend can take it: {detail}"))
            return CompileHandle(None, spec, [spec.backend], None, failed, False)
        # Only the backends preferred over the one that will try first had to be passed over.
        order = list(allowed_backends(spec.backend))
        passed = [n for n in order[: order.index(names[0])] if n in reasons]
        fallback = "; ".join(f"{n}: {reasons[n]}" for n in passed) or None
        future, hit = self._request(names[0], spec, bounded=True)
        return CompileHandle(self, spec, names, fallback, future, hit)

    @staticmethod
    def _spec_key(spec: StructuredOutputsParams) -> tuple[object, ...]:
        return (spec.kind, spec.spec_text, spec.options_key)

    def _key(self, name: str, spec: StructuredOutputsParams) -> tuple[object, ...]:
        key = self.backend(name).compile_key(spec)
        return (name, *(self._spec_key(spec) if key is None else key))

    def _request(
        self, name: str, spec: StructuredOutputsParams, bounded: bool
    ) -> tuple[Future[Compiled], bool]:
        """The future of ``spec`` on backend ``name``, queueing a compile when it is new;
        and whether it was already there (cached or in flight).

        Raises:
            CompileQueueFull: ``bounded`` and the queue is full.
        """
        key = self._key(name, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._counts[
                    "grammar_cache_hits" if future.done() else "grammar_compile_joined"
                ] += 1
                return future, True
            full = bounded and self._dispatcher.queue_length() >= self.pool.max_queued
            if not full:
                job = CompileJob(key, name, _portable(spec))
                self._cache[key] = job.future
                self._evict()
                self._counts["grammar_cache_misses"] += 1
        if full:
            raise self.refuse()
        job.future.add_done_callback(lambda f, key=key: self._sized(key, f))
        self._dispatcher.enqueue(job)
        return job.future, False

    def _sized(self, key: tuple[object, ...], future: Future[Compiled]) -> None:
        """Counts a finished compile's size against the cache budget (a failure kept in the
        cache by ``_forget`` counts as an entry of no bytes)."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            if self._cache.get(key) is not future:
                return  # evicted while it compiled
            nbytes = future.result().nbytes
            self._sizes[key] = nbytes
            self._cached_bytes += nbytes
            self._evict()

    def _evict(self) -> None:
        """Drops least recently used entries until both limits hold (caller holds the lock)."""
        while self._cache and (
            len(self._cache) > self._cache_size or self._cached_bytes > self._cache_bytes
        ):
            key, _ = self._cache.popitem(last=False)
            self._cached_bytes -= self._sizes.pop(key, 0)

    def _forget(self, job: CompileJob, error: BaseException) -> None:
        """Drops a failed compile from the cache, so the next request for it compiles again;
        unless the failure would repeat (the backend refused the spec, or the compile used up
        its running time): that failure stays cached, and later requests for the spec go
        straight to the next backend (or fail) instead of compiling it again."""
        if isinstance(error, SpecRejected) or (
            isinstance(error, CompileTimeout) and error.over_limit
        ):
            return
        with self._lock:
            if self._cache.get(job.key) is job.future:
                del self._cache[job.key]
                self._cached_bytes -= self._sizes.pop(job.key, 0)

    # ----------------------------------------------------------------- state
    def stats(self) -> dict[str, float | int]:
        """Counters and gauges of the compile service (all keys start with ``grammar_``).

        Gauges: ``grammar_compile_queue_length`` (specs waiting for a worker),
        ``grammar_compile_queue_limit``, ``grammar_compile_running``,
        ``grammar_compile_workers`` (live worker processes), ``grammar_cache_entries`` and
        ``grammar_cache_bytes`` (the cache's size against its budget). Counters:
        ``grammar_compiles`` (succeeded), ``grammar_compile_errors``, ``grammar_compile_timeouts``,
        ``grammar_compile_worker_starts``, ``grammar_compile_worker_kills`` (stopped at the
        limit), ``grammar_compile_worker_deaths`` (ended on their own),
        ``grammar_cache_hits``, ``grammar_cache_misses`` (compiles queued),
        ``grammar_compile_joined`` (requests served by a compile in flight),
        ``grammar_compile_rejected`` (refused: queue full). The compile-time histogram:
        ``grammar_compile_seconds_sum``, ``grammar_compile_seconds_count`` and cumulative
        ``grammar_compile_seconds_le_<bound>`` for each bound in ``COMPILE_SECONDS_BUCKETS``.
        """
        with self._lock:
            counts = dict(self._counts)
            counts["grammar_cache_entries"] = len(self._cache)
            counts["grammar_cache_bytes"] = self._cached_bytes
        return {**counts, **self._dispatcher.stats()}

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes (running and idle)."""
        return self._dispatcher.worker_pids()

    def shutdown(self) -> None:
        """Stops the dispatcher and every worker process; pending compiles fail. Idempotent."""
        self._dispatcher.shutdown()


def _portable(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """``spec`` with a pydantic class replaced by its schema: a worker must not import the
    module that defined the class (it may be the user's ``__main__``)."""
    if isinstance(spec.json, type):
        return dataclasses.replace(spec, json=spec.schema)
    return spec


def default_compile_workers() -> int:
    """Compile workers for this machine: 2, or 1 on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2, cores or 1))


__all__ = [
    "AUTO_ORDER",
    "COMPILE_SECONDS_BUCKETS",
    "CompileHandle",
    "CompilePoolConfig",
    "CompileQueueFull",
    "CompileResult",
    "CompileService",
    "CompileTimeout",
    "default_compile_workers",
]
