"""The CPU's "device": a worker process that owns the model, its KV cache and the request rows.

A forward in a thread of the engine process would be starved by the GIL
(measured: 18 ms -> over 2 s while the engine thread runs Python), so on the
CPU the model runs in a worker process. The engine sends control messages
through a pipe (the step's ``SchedulerOutput``, which holds no tensors, then a
"sample" message); bitmasks and sampled tokens travel through preallocated
shared-memory tensors, double-buffered because two steps can be in flight.
The worker answers each "sample" with one message, in order, and the engine
reads it in ``get_output()`` only.

The worker is started through a forkserver that has imported torch but never
run a parallel region (forking a process that has is unsafe with OpenMP), and
it ignores SIGINT (the engine process owns Ctrl-C). It exits when the pipe
closes, so it dies with the engine process however that ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import signal
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.scheduler_output import (
    GrammarOutput,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.engine.sync_check import SyncChecker
from baton.engine.worker.build import RunnerSpec, build_runner
from baton.engine.worker.model_runner import ForwardOutput, runner_output
from baton.grammar.backend import allocate_bitmask

logger = logging.getLogger(__name__)

_SLOTS = 2  # steps in flight at most (max_concurrent_batches)
_START_TIMEOUT_S = 300.0
_POLL_S = 0.5


@dataclass(frozen=True)
class _Reply:
    """The worker's answer to one "sample" message."""

    step_id: int
    slot: int
    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    logprobs: dict[str, Logprobs]
    error: str | None
    device_seconds: float = 0.0  # the worker's forward + sampling time so far


@dataclass(frozen=True)
class _FailedStep:
    request_ids: tuple[str, ...]
    message: str


class _MpOutput(AsyncOutput):
    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self._executor, self._step_id = executor, step_id
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._receive(self._step_id)
        return self._output


def pack_weights(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Copies all weights into one shared-memory tensor (one file descriptor to pass)."""
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) != 1:
        raise ValueError(f"weights must share one dtype, got {dtypes}")
    total = sum(w.numel() for w in weights.values())
    flat = torch.empty(total, dtype=dtypes.pop()).share_memory_()
    index: dict[str, Any] = {}
    offset = 0
    for name, w in weights.items():
        flat[offset : offset + w.numel()].copy_(w.reshape(-1))
        index[name] = (offset, tuple(w.shape))
        offset += w.numel()
    return flat, index


def _unpack_weights(flat: torch.Tensor, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (offset, shape) in index.items():
        n = 1
        for d in shape:
            n *= d
        out[name] = flat[offset : offset + n].view(shape)
    return out


class MultiprocExecutor(Executor):
    """Runs the model runner in a worker process; every call returns at once.

    Raises:
        ExecutorError: the worker failed to start (its traceback is in the message).
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
        self._bitmasks = torch.stack([allocate_bitmask(rows, vocab) for _ in range(_SLOTS)])
        self._bitmasks.share_memory_()
        self._sampled = torch.zeros(_SLOTS, rows, dtype=torch.int64).share_memory_()
        self._slot = 0
        self._device_s = 0.0
        self._replies: dict[int, _Reply] = {}
        self._dead: str | None = None
        ctx = torch_mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "baton.engine.executor.multiproc"])
        # One pipe each way: the worker answers from a sender thread, so neither
        # side can block on a full pipe while the other blocks on its own send.
        self._replies_conn, replies_w = ctx.Pipe(duplex=False)
        commands_r, self._conn = ctx.Pipe(duplex=False)
        flat, index = pack_weights(weights)
        self._proc = ctx.Process(
            target=_worker_main,
            args=(commands_r, replies_w, spec, flat, index, self._bitmasks, self._sampled),
            name="baton-model-worker",
            daemon=True,
        )
        self._proc.start()
        commands_r.close()
        replies_w.close()
        del flat
        self._finalizer = weakref.finalize(
            self, _stop_worker, self._conn, self._replies_conn, self._proc
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._replies_conn.poll(_POLL_S):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.shutdown()
                raise ExecutorError(
                    f"model worker process did not start (exit code {self._proc.exitcode})"
                )
        try:
            kind, detail = self._replies_conn.recv()
        except (EOFError, OSError) as exc:
            self.shutdown()
            raise ExecutorError(f"model worker process died while starting: {exc}") from exc
        if kind != "ready":
            self.shutdown()
            raise ExecutorError(f"model worker process failed to start:\n{detail}")

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
                    if not self._replies_conn.poll(_POLL_S):
                        if not self._proc.is_alive():
                            self._died("the model worker process died")
                        continue
                    reply: _Reply = self._replies_conn.recv()
                except (EOFError, OSError) as exc:
                    self._died(f"the model worker process died: {exc}")
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
        code = self._proc.exitcode
        self._dead = f"{message} (exit code {code})" if code is not None else message
        raise ExecutorError(self._dead)

    def failure(self) -> str | None:
        if self._dead is not None:
            return self._dead
        if not self._proc.is_alive():
            return f"the model worker exited (exit code {self._proc.exitcode})"
        return None

    def supports_async_scheduling(self) -> bool:
        return True

    @property
    def device_seconds(self) -> float:
        return self._device_s

    def shutdown(self) -> None:
        self._finalizer()


def _stop_worker(commands: Connection, replies: Connection, proc: Any) -> None:
    with contextlib.suppress(OSError, EOFError, BrokenPipeError):
        commands.send(("shutdown",))
    proc.join(timeout=5)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    commands.close()
    replies.close()


# ------------------------------------------------------------------- worker
def _worker_main(
    commands: Connection,
    replies: Connection,
    spec: RunnerSpec,
    flat: torch.Tensor,
    index: dict[str, Any],
    bitmasks: torch.Tensor,
    sampled: torch.Tensor,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        runner = build_runner(spec, _unpack_weights(flat, index))
        del flat
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        replies.send(("error", traceback.format_exc()))
        return
    replies.send(("ready", None))
    outbox: queue.SimpleQueue[_Reply | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_replies, args=(replies, outbox), daemon=True)
    sender.start()
    pending: deque[ForwardOutput | _FailedStep] = deque()
    busy = 0.0
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            break  # the engine is gone
        kind = message[0]
        t0 = time.perf_counter()
        if kind == "execute":
            so: SchedulerOutput = message[1]
            try:
                pending.append(runner.execute_model(so))
            except Exception:  # noqa: BLE001 - fails this step's requests, not the worker
                message = f"model step failed:\n{traceback.format_exc()}"
                pending.append(_FailedStep(tuple(so.num_scheduled_tokens), message))
            busy += time.perf_counter() - t0
        elif kind == "sample":
            _, step_id, slot, grammar_ids = message
            reply = _sample(runner, pending, step_id, slot, grammar_ids, bitmasks, sampled)
            busy += time.perf_counter() - t0
            outbox.put(dataclasses.replace(reply, device_seconds=busy))
        elif kind == "shutdown":
            break
    outbox.put(None)
    sender.join(timeout=5)


def _send_replies(replies: Connection, outbox: queue.SimpleQueue[_Reply | None]) -> None:
    while (reply := outbox.get()) is not None:
        try:
            replies.send(reply)
        except (OSError, EOFError, BrokenPipeError):
            return


def _sample(
    runner: Any,
    pending: deque[ForwardOutput | _FailedStep],
    step_id: int,
    slot: int,
    grammar_ids: tuple[str, ...],
    bitmasks: torch.Tensor,
    sampled: torch.Tensor,
) -> _Reply:
    fwd = pending.popleft() if pending else _FailedStep((), "sample_tokens without a forward")
    if isinstance(fwd, _FailedStep):
        return _Reply(step_id, slot, fwd.request_ids, (), {}, fwd.message)
    grammar = None
    if grammar_ids:
        grammar = GrammarOutput(grammar_ids, bitmasks[slot, : len(grammar_ids)])
    try:
        s = runner.sample(fwd, grammar)
        sampled[slot, : s.token_ids.numel()].copy_(s.token_ids)
    except Exception:  # noqa: BLE001 - fails this step's requests, not the worker
        message = f"sampling failed:\n{traceback.format_exc()}"
        return _Reply(step_id, slot, fwd.request_ids, (), {}, message)
    return _Reply(step_id, slot, s.request_ids, s.sample_request_ids, s.logprobs, None)
