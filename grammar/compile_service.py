"""Compiles grammars off the engine thread: a thread pool, an LRU cache, a time limit.

The engine submits a spec and polls the returned handle once per step; a
request whose grammar is still compiling waits without holding up anyone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from baton.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
from baton.grammar.spec import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Preference order of "auto".
AUTO_ORDER = ("xgrammar", "outlines")


@dataclass(frozen=True)
class CompileResult:
    """The outcome of one compile request.

    Attributes:
        grammar: the compiled grammar, or None on failure.
        backend: the backend that served it (or last tried).
        fallback_reason: why the preferred backend was not used, if it was not.
        error: the failure message (compile error or time-out), if any.
        seconds: compile time (0 for a cache hit).
        cache_hit: served from the cache.
    """

    grammar: CompiledGrammar | None
    backend: str
    fallback_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0
    cache_hit: bool = False


class CompileHandle:
    """A pending compile: ``result()`` is None until it is done or timed out."""

    def __init__(self, future: Future[CompileResult], deadline: float) -> None:
        self._future = future
        self._deadline = deadline
        self._timed_out: CompileResult | None = None

    def result(self, now: float | None = None) -> CompileResult | None:
        """The result when ready; a time-out error once the deadline has passed."""
        if self._future.done():
            exc = self._future.exception()
            if exc is not None:
                return CompileResult(None, "", error=f"{type(exc).__name__}: {exc}")
            return self._future.result()
        if self._timed_out is None and (now or time.monotonic()) >= self._deadline:
            self._timed_out = CompileResult(None, "", error="grammar compilation timed out")
        return self._timed_out


class CompileService:
    """Chooses a backend per spec and compiles it in a thread pool, with an LRU cache.

    Args:
        backends: name -> backend (made lazily by the callables, at first use).
        timeout_s: time limit of one compile; a slower one fails its request
            (the worker thread finishes in the background and its result is
            still cached for later requests).
        cache_size: compiled grammars kept.
        max_workers: compile threads.
    """

    def __init__(
        self,
        backends: Mapping[str, Callable[[], GrammarBackend]],
        timeout_s: float = 10.0,
        cache_size: int = 256,
        max_workers: int = 2,
    ) -> None:
        if timeout_s <= 0 or cache_size < 1 or max_workers < 1:
            raise ValueError("timeout_s must be > 0, cache_size and max_workers >= 1")
        self._factories = dict(backends)
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="baton-grammar")
        self.hits = 0
        self.misses = 0

    def backend(self, name: str) -> GrammarBackend:
        """The backend called ``name``, built on first use."""
        with self._backend_lock:
            if name not in self._backends:
                if name not in self._factories:
                    raise ValueError(f"unknown structured-output backend {name!r}")
                self._backends[name] = self._factories[name]()
            return self._backends[name]

    def candidates(self, spec: StructuredOutputsParams) -> tuple[list[str], dict[str, str]]:
        """Backends that can take ``spec`` in preference order, and why the others cannot."""
        names = list(AUTO_ORDER) if spec.backend == "auto" else [spec.backend]
        ok, reasons = [], {}
        for name in names:
            if name not in self._factories:
                reasons[name] = "not available"
                continue
            reason = self.backend(name).unsupported_reason(spec)
            if reason is None:
                ok.append(name)
            else:
                reasons[name] = reason
        return ok, reasons

    def submit(self, spec: StructuredOutputsParams) -> CompileHandle:
        """Starts compiling ``spec`` (or finds it cached); never blocks on a compile."""
        deadline = time.monotonic() + self.timeout_s
        names, reasons = self.candidates(spec)
        if not names:
            detail = "; ".join(f"{n}: {r}" for n, r in reasons.items())
            done: Future[CompileResult] = Future()
            done.set_result(
                CompileResult(None, spec.backend, error=f"no backend can take it: {detail}")
            )
            return CompileHandle(done, deadline)
        fallback = "; ".join(f"{n}: {r}" for n, r in reasons.items()) or None
        future = self._pool.submit(self._compile_chain, spec, names, fallback)
        return CompileHandle(future, deadline)

    def _compile_chain(
        self, spec: StructuredOutputsParams, names: list[str], fallback: str | None
    ) -> CompileResult:
        errors = []
        for name in names:
            t0 = time.monotonic()
            try:
                grammar, hit = self._compile_cached(name, spec)
            except GrammarError as exc:
                errors.append(f"{name}: {exc}")
                continue
            reason = "; ".join(filter(None, [fallback, *errors])) or None
            return CompileResult(grammar, name, reason, None, time.monotonic() - t0, hit)
        return CompileResult(None, names[-1], fallback, "; ".join(errors))

    def _compile_cached(
        self, name: str, spec: StructuredOutputsParams
    ) -> tuple[CompiledGrammar, bool]:
        backend = self.backend(name)
        key = (
            name,
            spec.kind,
            spec.spec_text,
            spec.options_key,
            getattr(backend, "vocab_key", None),
        )
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                hit = True
            else:
                future = Future()
                self._cache[key] = future
                self.misses += 1
                hit = False
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if hit:
            return future.result(), True
        try:
            grammar = backend.compile(spec)
        except BaseException as exc:  # noqa: BLE001 - a backend bug fails this spec only
            # BaseException too (PyO3 panics are one): an unresolved cache entry would block
            # every later compile of this spec, and the pool threads it runs on, for good.
            err = (
                exc
                if isinstance(exc, GrammarError)
                else GrammarError(f"{type(exc).__name__}: {exc}")
            )
            with self._lock:
                self._cache.pop(key, None)
            future.set_exception(err)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise err from exc
        future.set_result(grammar)
        return grammar, False

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
