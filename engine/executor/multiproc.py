"""The CPU's "device": a worker process that owns the model, its KV cache and the request rows.

A forward in a thread of the engine process would be starved by the GIL
(measured: 18 ms -> over 2 s while the engine thread runs Python), so on the
CPU the model runs in a worker process (``worker/worker_main.py``), started as a fresh
interpreter that never imports the user's ``__main__`` (``worker_process.py``). The engine
sends control messages through a socket (the step's ``SchedulerOutput``, which holds no
tensors, then a "sample" message); weights, bitmasks and sampled tokens lie in shared memory
that the worker maps through inherited descriptors, the bitmasks and tokens double-buffered
because two steps can be in flight. The worker answers each "sample" with one message, in
order, and the engine reads it in ``get_output()`` only.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch

from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.executor.worker_process import WorkerProcess
from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.sync_check import SyncChecker
from baton.engine.worker.build import RunnerSpec
from baton.engine.worker.model_runner import runner_output
from baton.engine.worker.shared_memory import SharedBuffer, pack_layouts
from baton.engine.worker.worker_main import Reply, WorkerInit
from baton.grammar.backend import bitmask_width

logger = logging.getLogger(__name__)

_SLOTS = 2  # steps in flight at most (max_concurrent_batches)
_START_TIMEOUT_S = 300.0
_POLL_S = 0.5


class _MpOutput(AsyncOutput):
    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self._executor, self._step_id = executor, step_id
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._receive(self._step_id)
        return self._output


def _share_weights(weights: dict[str, torch.Tensor]) -> tuple[SharedBuffer, dict[str, Any]]:
    """Copies all weights into one shared buffer (one descriptor to pass)."""
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) != 1:
        raise ValueError(f"weights must share one dtype, got {dtypes}")
    layouts, total = pack_layouts({n: (w.dtype, tuple(w.shape)) for n, w in weights.items()})
    buf = SharedBuffer.create(total, "baton-weights")
    for name, w in weights.items():
        buf.tensor(layouts[name]).copy_(w)
    return buf, layouts


class MultiprocExecutor(Executor):
    """Runs the model runner in a worker process; every call returns at once.

    Raises:
        ExecutorError: the worker failed to start; the message says why (its traceback, or
            how it ended).
    """

    def __init__(
        self,
        spec: RunnerSpec,
        weights: dict[str, torch.Tensor],
        checker: SyncChecker | None = None,
    ) -> None:
        self._checker = checker or SyncChecker("off")
        vocab = spec.model_config.vocab_size
        rows = spec.max_num_seqs
        words = bitmask_width(vocab)
        io_layouts, io_total = pack_layouts(
            {
                "bitmasks": (torch.int32, (_SLOTS, rows, words)),
                "sampled": (torch.int64, (_SLOTS, rows)),
            }
        )
        self._slot = 0
        self._device_s = 0.0
        self._replies: dict[int, Reply] = {}
        self._dead: str | None = None
        try:
            io = SharedBuffer.create(io_total, "baton-step-io")
            shared_weights, weight_layouts = _share_weights(weights)
        except OSError as exc:
            raise ExecutorError(
                f"cannot allocate shared memory for the model worker: {exc}"
            ) from exc
        self._bitmasks = io.tensor(io_layouts["bitmasks"])
        self._bitmasks.fill_(-1)
        self._sampled = io.tensor(io_layouts["sampled"])
        init = WorkerInit(
            spec=spec,
            weights_fd=shared_weights.fd,
            weights_nbytes=shared_weights.nbytes,
            weights=weight_layouts,
            io_fd=io.fd,
            io_nbytes=io.nbytes,
            bitmasks=io_layouts["bitmasks"],
            sampled=io_layouts["sampled"],
        )
        try:
            self._worker = WorkerProcess((shared_weights.fd, io.fd))
        except OSError as exc:
            raise ExecutorError(f"cannot start the model worker process: {exc}") from exc
        finally:
            # The worker holds its own copies of the descriptors now; the weights' pages live
            # on in its mapping only.
            shared_weights.close()
            io.close()
            del shared_weights
        self._conn = self._worker.conn
        self._finalizer = weakref.finalize(self, self._worker.stop)
        try:
            self._conn.send(init)
        except (OSError, EOFError, BrokenPipeError) as exc:
            self._start_failed(f"cannot reach it: {exc}")
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._conn.poll(_POLL_S):
            if not self._worker.is_alive():
                break  # its last message, if any, is still readable
            if time.monotonic() > deadline:
                self._start_failed(f"not ready after {_START_TIMEOUT_S:.0f} s")
        try:
            kind, detail = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._worker.stop()
            ended = self._worker.exit_description() or "still running"
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._start_failed(f"it ended without a reason ({ended}; {reason})")
        if kind != "ready":
            self._start_failed(f"\n{detail}")

    def _start_failed(self, reason: str) -> None:
        self.shutdown()
        raise ExecutorError(f"the model worker process failed to start: {reason}")

    @property
    def worker_pid(self) -> int:
        """The model worker's process id (for tests and monitoring)."""
        return self._worker.pid

    # ----------------------------------------------------------------- steps
    def execute_model(self, so: SchedulerOutput) -> None:
        self._send(("execute", so))

    def sample_tokens(self, step_id: int, grammar: GrammarOutput | None) -> AsyncOutput:
        slot = self._slot
        self._slot = (self._slot + 1) % _SLOTS
        request_ids: tuple[str, ...] = ()
        if grammar is not None and grammar.request_ids:
            n = len(grammar.request_ids)
            target = self._bitmasks[slot, :n]
            if grammar.bitmask.data_ptr() != target.data_ptr():  # not filled in place
                target.copy_(grammar.bitmask[:n])
            request_ids = grammar.request_ids
        self._send(("sample", step_id, slot, request_ids))
        return _MpOutput(self, step_id)

    def bitmask_buffer(self) -> torch.Tensor:
        return self._bitmasks[self._slot]

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._dead is not None:
            raise ExecutorError(self._dead)
        try:
            self._conn.send(message)
        except (OSError, EOFError, BrokenPipeError) as exc:
            self._died(f"cannot reach the model worker process: {exc}")

    def _receive(self, step_id: int) -> ModelRunnerOutput:
        with self._checker.allow():
            while step_id not in self._replies:
                if self._dead is not None:
                    raise ExecutorError(self._dead)
                try:
                    if not self._conn.poll(_POLL_S):
                        if not self._worker.is_alive():
                            self._died("the model worker process died")
                        continue
                    reply: Reply = self._conn.recv()
                except (EOFError, OSError) as exc:
                    self._died(f"the model worker process died: {type(exc).__name__} {exc}")
                self._replies[reply.step_id] = reply
            reply = self._replies.pop(step_id)
            self._device_s = reply.device_seconds
            if reply.error is not None:  # this step's requests fail; the others go on
                return ModelRunnerOutput(
                    request_ids=list(reply.request_ids),
                    sampled_token_ids=[[] for _ in reply.request_ids],
                    errors=dict.fromkeys(reply.request_ids, reply.error),
                )
            n = len(reply.sample_request_ids)
            tokens = self._sampled[reply.slot, :n].tolist()
        return runner_output(reply.request_ids, reply.sample_request_ids, tokens, reply.logprobs)

    def _died(self, message: str) -> None:
        ended = self._worker.exit_description()
        self._dead = f"{message} ({ended})" if ended is not None else message
        raise ExecutorError(self._dead)

    def failure(self) -> str | None:
        if self._dead is not None:
            return self._dead
        ended = self._worker.exit_description()
        if ended is not None:
            return f"the model worker exited ({ended})"
        return None

    def supports_async_scheduling(self) -> bool:
        return True

    @property
    def device_seconds(self) -> float:
        return self._device_s

    def shutdown(self) -> None:
        self._finalizer()
