"""The engine's handles on its compile worker processes: start, send, kill.

One template process (the zygote, see ``worker``) is started with ``subprocess`` the
first time a worker is needed; every worker is then forked from it in milliseconds and talks
to the engine over its own socket. Only the compile service's dispatcher thread uses these
objects, so they hold no locks; the one exception is ``Zygote.close`` at shutdown, which may
run while that thread waits for the zygote to start (that start then fails with
``WorkerStartError``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from baton.grammar.backend import BackendRecipe
from baton.grammar.compile.worker import THREAD_ENV
from baton.grammar.vocab import Vocab

logger = logging.getLogger(__name__)

# A fresh interpreter with the engine's import path that runs only the zygote: nothing
# imports the user's __main__ (multiprocessing's spawn and forkserver would). Once its workers
# are reaped it leaves with os._exit: tearing down an interpreter that imported torch and the
# backends took ~0.9 s, which every engine shutdown waited for, and nothing is left to
# finalise (its sockets close with the process).
_BOOTSTRAP = (
    "import os, sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
    "from baton.grammar.compile.worker import zygote_main; "
    "code = zygote_main(int(sys.argv[1])); sys.stdout.flush(); sys.stderr.flush(); "
    "os._exit(code)"
)
_ZYGOTE_EXIT_S = 5.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class WorkerStartError(RuntimeError):
    """The compile worker processes cannot be started (the message says why)."""


class CompileWorker:
    """One forked compile worker: its pid and its connection.

    ``kill`` is safe against pid reuse where Linux pidfds exist (the worker is reaped by
    the kernel as soon as it ends, so a plain pid may name another process by then).
    """

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self.conn = conn
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:  # already gone: its socket reads EOF, and kill has nothing to do
                self._pidfd = None
        self.alive = True

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the worker has used so far; None where the
        system does not say (not Linux) or the worker has ended."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # Fields 14 and 15 of stat(5), counted after the ")" that closes the command name.
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def send(self, message: object) -> None:
        """Sends one message. Raises OSError (or EOFError) when the worker has gone."""
        self.conn.send(message)

    def kill(self) -> None:
        """Ends the worker at once (SIGKILL) and closes its connection; idempotent."""
        if not self.alive:
            return
        self.alive = False
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif not hasattr(os, "pidfd_open"):
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass
        self._close()

    def close(self) -> None:
        """Closes the connection: an idle worker then exits by itself."""
        if self.alive:
            self.alive = False
            self._close()

    def _close(self) -> None:
        self.conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Zygote:
    """The template process that forks compile workers; started on the first ``fork``.

    Args:
        recipes: the backends every worker compiles with.
        vocab: the vocabulary, sent once (the workers inherit it).
        vocab_size: the model's vocabulary size.
        memory_limit_bytes: address space each worker may add to the zygote's (None: no cap).
    """

    def __init__(
        self,
        recipes: Sequence[BackendRecipe],
        vocab: Vocab,
        vocab_size: int,
        memory_limit_bytes: int | None,
    ) -> None:
        self._init = ("init", tuple(recipes), vocab, vocab_size, memory_limit_bytes)
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.failure: str | None = None

    def fork(self) -> CompileWorker:
        """A new worker, starting the zygote first if needed (that takes about as long as
        importing xgrammar: seconds).

        Raises:
            WorkerStartError: the zygote cannot start or has died.
        """
        if self.failure is not None:
            raise WorkerStartError(self.failure)
        try:
            conn = self._conn or self._start()
            conn.send(("fork",))
            tag, pid = conn.recv()
            fd = recv_handle(conn)
        except (OSError, EOFError, TypeError, ValueError) as exc:  # TypeError: as in `_start`
            self.failure = f"the compile worker template process ended: {exc or type(exc).__name__}"
            self.close()
            raise WorkerStartError(self.failure) from None
        if tag != "forked":
            raise WorkerStartError(f"unexpected answer from the compile worker template: {tag}")
        return CompileWorker(pid, Connection(fd))

    def _start(self) -> Connection:
        ours, theirs = socket.socketpair()
        env = {**os.environ, **THREAD_ENV}
        paths = json.dumps([p for p in sys.path if p])
        try:
            self._proc = proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()), paths],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                close_fds=True,
                # Its own process group, which its workers join: the zygote can end them all
                # at once, and a Ctrl-C meant for the engine's terminal reaches the engine only.
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            self.failure = f"cannot start the compile worker process: {exc}"
            raise WorkerStartError(self.failure) from None
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        self._conn = conn
        try:
            conn.send(self._init)
            answer = conn.recv()
        # TypeError / ValueError: `close` (another thread, shutting down) closed the connection
        # while this one waited on it.
        except (OSError, EOFError, TypeError, ValueError) as exc:
            code = proc.poll()
            self.failure = (
                "the compile worker process failed to start"
                + (f" (exit code {code})" if code is not None else "")
                + f": {exc or type(exc).__name__} (see its error output above)"
            )
            self.close()
            raise WorkerStartError(self.failure) from None
        if answer[0] != "ready":
            self.failure = f"the compile worker process cannot build the backends: {answer[1]}"
            self.close()
            raise WorkerStartError(self.failure)
        logger.info("grammar compile worker template started (pid %d)", proc.pid)
        return conn

    @property
    def pid(self) -> int | None:
        """The zygote's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def close(self) -> None:
        """Ends the zygote; every worker forked from it ends with it. Idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(_ZYGOTE_EXIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


__all__ = ["CompileWorker", "WorkerStartError", "Zygote"]
