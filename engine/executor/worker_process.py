"""Starting the model worker process so that it never runs the user's script.

multiprocessing's spawn and forkserver children re-import the parent's ``__main__``: a script
with ``llm = LLM(...)`` at top level (no ``if __name__ == "__main__"`` guard) would build a
second engine inside the worker, which then dies while starting. So the worker is a fresh
interpreter (``subprocess``) that runs a two-line bootstrap: put the engine's import path
first, import ``baton.engine.worker.worker_main`` and serve. It talks to the engine over an
inherited socket; the shared buffers' descriptors follow over that socket (``hand_over``), so
the worker can be started, and import torch, while the engine is still reading the model. A
failure before it is ready comes back as its traceback, or else as its exit code or signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection

from baton.engine.worker.fd_passing import send_fds
from baton.engine.worker.messages import Shutdown

# Runs in the fresh interpreter. An import failure is sent to the engine as the reason: a
# ``Failed``, or its bare text where even ``messages`` cannot be imported (nothing of baton's is
# imported before the engine's import path is put first). After
# serving it leaves with os._exit: tearing down an interpreter that imported torch took ~0.6 s,
# which every engine shutdown waited for, and nothing is left to finalise (the shared buffers
# are the engine's, mapped through inherited descriptors; everything was sent).
_BOOTSTRAP = """\
import os, sys, json, traceback
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
try:
    sys.path[:0] = json.loads(sys.argv[2])
    from baton.engine.worker.worker_main import serve
except BaseException:
    why = "cannot import the model worker:\\n" + traceback.format_exc()
    try:
        from baton.engine.worker.messages import Failed
        conn.send(Failed(why))
    except BaseException:
        conn.send(why)
    raise SystemExit(1)
code = serve(conn)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""
_STOP_S = 5.0


class WorkerProcess:
    """A started model worker: its pid, its connection, how it ended. It imports the runner
    at once, then waits for ``hand_over``'s descriptors and the init message.

    Args:
        env: environment overrides (e.g. thread counts) for the worker.

    Raises:
        OSError: the interpreter cannot be started (the message says why).
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair()
        paths = json.dumps([p for p in sys.path if p])
        self._handed = False
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()), paths],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                close_fds=True,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def hand_over(self, fds: Sequence[int]) -> None:
        """Sends the worker ``fds`` (the shared buffers; they stay open here too), before the
        init message. Once per worker.

        Raises:
            OSError: the worker cannot be reached. ValueError: more than 8 descriptors.
        """
        if self._handed:
            raise RuntimeError("the worker already has its descriptors")
        send_fds(self.conn, fds)
        self._handed = True

    @property
    def pid(self) -> int:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def exit_description(self) -> str | None:
        """How the worker ended ("exit code 1", "killed by signal SIGKILL"), None while alive."""
        code = self._proc.poll()
        if code is None:
            return None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            hint = " (out of memory?)" if -code == signal.SIGKILL else ""
            return f"killed by signal {name}{hint}"
        return f"exit code {code}"

    def stop(self) -> None:
        """Asks the worker to stop, then ends it if it does not; idempotent. A worker that
        never got its descriptors holds nothing of the engine's: it is terminated at once
        rather than waited for (it may still be importing torch)."""
        if not self._handed and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait()
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, EOFError, BrokenPipeError, ValueError):
                self.conn.send(Shutdown())
            try:
                self._proc.wait(_STOP_S)
            except subprocess.TimeoutExpired:
                self._proc.terminate()
                try:
                    self._proc.wait(_STOP_S)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
        if not self.conn.closed:
            self.conn.close()
