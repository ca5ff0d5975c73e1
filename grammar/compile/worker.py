"""The compile worker processes' side: a template process that forks one worker per slot.

The engine starts the template ("zygote") with ``subprocess`` running
``python -c "...; zygote_main(FD)"``: a fresh interpreter that imports only baton's grammar
package and its backends (never the user's ``__main__``, so a script without an
``if __name__ == "__main__":`` guard is safe). It receives the vocabulary and the backend
recipes once, builds the backends, and then forks a worker per request of the engine; each
worker shares those backends copy-on-write, starts in milliseconds, and serves compiles until
the engine closes it or kills it.

Protocol (pickled messages, ``multiprocessing.connection`` framing):

    engine -> zygote: ("init", recipes, vocab, vocab_size, memory_limit_bytes) once, then
                      ("fork",) per worker; closing the socket ends the zygote and, through
                      the parent-death signal, every worker.
    zygote -> engine: ("ready",) or ("failed", text) after init; per fork ("forked", pid)
                      followed by the worker's socket (SCM_RIGHTS).
    engine -> worker: (job_id, backend name, spec) per compile.
    worker -> engine: ("ok", job_id, payload bytes, seconds, private_bytes) or
                      ("error", job_id, message, seconds, private_bytes, kind), kind being
                      "compile" (the spec cannot be compiled) or "memory" (out of its limit).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from baton.grammar.backend import BackendRecipe, GrammarBackend, GrammarError

# Thread pools of numerical libraries: a compile worker never runs tensor work, and an idle
# pool thread at fork time is one thread too many.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_PR_SET_PDEATHSIG = 1
_MEMORY_MARKERS = ("bad_alloc", "MemoryError", "out of memory", "Cannot allocate memory")


def zygote_main(control_fd: int) -> int:
    """Runs the template process on the connected socket ``control_fd``; returns the exit code."""
    conn = Connection(control_fd)
    try:
        msg = conn.recv()
    except EOFError:
        return 0
    _, recipes, vocab, vocab_size, memory_limit = msg
    try:
        backends = {r.name: r.build(vocab, vocab_size) for r in recipes}
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which fails the compiles
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    # The kernel reaps the workers: the engine learns of a worker's end from its socket.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    conn.send(("ready",))
    try:
        _serve_forks(conn, backends, memory_limit)
    finally:
        _end_workers()
    return 0


def _serve_forks(
    conn: Connection, backends: Mapping[str, GrammarBackend], memory_limit: int | None
) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "fork":
            return
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                conn.close()
                ours.close()
                code = _worker(theirs, backends, memory_limit, zygote=os.getppid())
            finally:
                os._exit(code)
        theirs.close()
        conn.send(("forked", pid))
        send_handle(conn, ours.fileno(), pid)
        ours.close()


def _end_workers() -> None:
    """Stops and reaps every worker still running (the zygote leads their process group),
    so that none is left behind for an init process that may not reap."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.killpg(os.getpgrp(), signal.SIGTERM)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _worker(
    sock: socket.socket,
    backends: Mapping[str, GrammarBackend],
    memory_limit: int | None,
    zygote: int,
) -> int:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(zygote)
    if memory_limit is not None:
        _limit_address_space(memory_limit)
    conn = Connection(sock.detach())
    while True:
        try:
            job_id, name, spec = conn.recv()
        except (EOFError, OSError):
            return 0
        t0 = time.perf_counter()
        try:
            backend = backends[name]
            payload = backend.export_compiled(backend.compile(spec))
            reply: tuple[object, ...] = ("ok", job_id, payload)
        except MemoryError:
            reply = ("error", job_id, "out of memory", "memory")
        except GrammarError as exc:
            kind = "memory" if any(m in str(exc) for m in _MEMORY_MARKERS) else "compile"
            reply = ("error", job_id, str(exc), kind)
        except BaseException as exc:  # noqa: BLE001 - a backend bug fails this spec only
            # BaseException: PyO3 panics are one. The engine gets the reason, not a dead worker.
            traceback.print_exc(file=sys.stderr)
            reply = ("error", job_id, f"{type(exc).__name__}: {exc}", "internal")
        seconds = time.perf_counter() - t0
        head, tail = reply[:3], reply[3:]
        try:
            conn.send((*head, seconds, _private_bytes(), *tail))
        except (EOFError, OSError):
            return 0


def _die_with_parent(parent: int) -> None:
    """Asks Linux to kill this worker when the zygote ends (then the engine has ended too)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the zygote ended before the request took effect
        os._exit(0)


def _limit_address_space(extra_bytes: int) -> None:
    """Caps this process at its current address space plus ``extra_bytes``: a compile that
    needs more fails with an allocation error instead of exhausting the machine."""
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = current + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        return


def _private_bytes() -> int:
    """Memory this worker does not share with the zygote (0 where unknown)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kb = sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty"))
    except (OSError, KeyError, ValueError):
        return 0
    return kb * 1024


__all__ = ["THREAD_ENV", "BackendRecipe", "zygote_main"]
