"""The CPU's "device": a worker process that owns the model, its KV cache and the request rows.

A forward in a thread of the engine process would be starved by the GIL
(measured: 18 ms -> over 2 s while the engine thread runs Python), so on the
CPU the model runs in a worker process (``worker/worker_main.py``), started as a fresh
interpreter that never imports the user's ``__main__`` (``worker_process.py``). The engine
sends typed control messages through a socket (``worker/messages.py``: ``Execute`` with the
step's ``SchedulerOutput``, which holds no tensors, then ``Sample``); weights, bitmasks and
sampled tokens lie in shared memory that the worker maps through inherited descriptors, the
bitmasks and tokens double-buffered because two steps can be in flight. The worker answers
each ``Sample`` with one ``Reply``, in order, and the engine reads it in ``get_output()`` only.

With ``spec.tensor_parallel_size`` N > 1 there are N workers, one per rank, each given only
its shard of the weights (``models/sharding.py``) in its own shared buffer, joining one
``torch.distributed`` group through a TCP store this process hosts on loopback. Each ``Execute``
is written once into a shared ring that every rank reads (``worker/step_broadcast.py``); every
rank gets ``Sample``, but only rank 0 reads the bitmask, samples and answers. A rank that dies
ends the executor, as the single worker does.
"""

from __future__ import annotations

import datetime
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.executor.worker_process import WorkerProcess
from baton.engine.models.sharding import check_tensor_parallel, shard_weights
from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.sync_check import SyncChecker
from baton.engine.worker.build import RunnerSpec
from baton.engine.worker.cpu_threads import ThreadState
from baton.engine.worker.messages import (
    Execute,
    Failed,
    Ready,
    Rung,
    Sample,
    WorkerCommand,
    failure_text,
)
from baton.engine.worker.runner_values import runner_output
from baton.engine.worker.shared_memory import (
    QuantLayout,
    SharedBuffer,
    TensorLayout,
    pack_layouts,
)
from baton.engine.worker.spec_decode import DraftLayout
from baton.engine.worker.step_broadcast import StepBroadcaster
from baton.engine.worker.worker_main import Reply, WorkerInit
from baton.grammar.backend import bitmask_width
from baton.kernels.quant_formats import QuantWeight

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


# Prefix of a quantised weight's bytes among the shared buffer's layouts (no dense weight
# name has a colon).
_QUANT_PREFIX = "quant:"


def _share_weights(
    weights: dict[str, torch.Tensor], quantized: Mapping[str, QuantWeight] | None = None
) -> tuple[SharedBuffer, dict[str, TensorLayout], dict[str, QuantLayout]]:
    """Copies all weights into one shared buffer (one descriptor to pass): the dense ones (of
    any dtypes) and the quantised ones' packed bytes. Returns the buffer and where each lies."""
    quantized = quantized or {}
    shapes = {n: (w.dtype, tuple(w.shape)) for n, w in weights.items()}
    shapes.update({_QUANT_PREFIX + n: (torch.uint8, (q.nbytes,)) for n, q in quantized.items()})
    layouts, total = pack_layouts(shapes)
    buf = SharedBuffer.create(total, "baton-weights")
    for name, w in weights.items():
        buf.tensor(layouts[name]).copy_(w)
    quant_layouts = {}
    for name, q in quantized.items():
        data = layouts.pop(_QUANT_PREFIX + name)
        buf.tensor(data).copy_(q.data)
        quant_layouts[name] = QuantLayout(q.format, q.n, q.k, data)
    return buf, layouts, quant_layouts


def _step_io_layouts(spec: RunnerSpec) -> tuple[dict[str, TensorLayout], int]:
    """Where the double-buffered bitmasks and sampled tokens lie in the step I/O buffer: a
    logits row per request and one more per draft (speculative decoding), per slot."""
    rows = spec.max_num_seqs * (1 + spec.max_drafts)
    return pack_layouts(
        {
            "bitmasks": (torch.int32, (_SLOTS, rows, bitmask_width(spec.model_config.vocab_size))),
            "sampled": (torch.int64, (_SLOTS, rows)),
        }
    )


class MultiprocExecutor(Executor):
    """Runs the model runner in a worker process (one per tensor-parallel rank); every call
    returns at once.

    ``weights``: the whole model's (cut here for each rank), or a function that gives rank
    ``r``'s shard (called once per rank, in order). ``quantized``: GGUF-quantised linears
    (``spec.quantization="gguf"``, one rank only), shared with the worker beside ``weights``.
    ``prestarted``: rank 0's worker process, started earlier (``WorkerProcess()``) so that it
    imported the runner while the model was read; stopped here if the start fails after this
    takes it.

    Raises:
        ExecutorError: a worker failed to start; the message says why (its traceback, or
            how it ended).
        ValueError: the model cannot be cut into ``spec.tensor_parallel_size`` shards, or
            ``quantized`` with more than one.
    """

    def __init__(
        self,
        spec: RunnerSpec,
        weights: dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor]],
        checker: SyncChecker | None = None,
        quantized: Mapping[str, QuantWeight] | None = None,
        prestarted: WorkerProcess | None = None,
    ) -> None:
        self._checker = checker or SyncChecker("off")
        size = spec.tensor_parallel_size
        check_tensor_parallel(spec.model_config, size)
        if quantized and size > 1:
            raise ValueError(
                f"GGUF-quantised weights cannot be cut into {size} tensor-parallel shards yet"
            )
        self._slot = 0
        self._device_s = 0.0
        self._collective_s = 0.0
        self._threads: ThreadState | None = None
        self._replies: dict[int, Reply] = {}
        self._dead: str | None = None
        self._workers: list[WorkerProcess] = []
        self._store: dist.TCPStore | None = None
        self._ring: StepBroadcaster | None = None
        io_layouts, io_total = _step_io_layouts(spec)
        io, rank_weights = self._share_memory(spec, weights, quantized, io_total)
        self._bitmasks = io.tensor(io_layouts["bitmasks"])
        self._bitmasks.fill_(-1)
        self._sampled = io.tensor(io_layouts["sampled"])
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        try:
            for rank, (buf, layouts, quant_layouts) in enumerate(rank_weights):
                early = prestarted if rank == 0 else None
                self._start_worker(spec, rank, buf, layouts, quant_layouts, io, io_layouts, early)
        finally:
            for buf in [io, *(buf for buf, _, _ in rank_weights)]:
                buf.close()
            if self._ring is not None:
                self._ring.close()
            # Unmaps the weights here: their pages live on in the workers' mappings only.
            rank_weights.clear()
        self._conn = self._workers[0].conn
        for rank, worker in enumerate(self._workers):
            self._wait_ready(worker, rank)

    def _share_memory(
        self,
        spec: RunnerSpec,
        weights: dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor]],
        quantized: Mapping[str, QuantWeight] | None,
        io_total: int,
    ) -> tuple[
        SharedBuffer, list[tuple[SharedBuffer, dict[str, TensorLayout], dict[str, QuantLayout]]]
    ]:
        """The step I/O buffer and each rank's weights in a shared buffer of its own; with
        several ranks also the step ring and the TCP store they meet through (``_ring``,
        ``_store``). Closes what it made before raising.

        Raises:
            ExecutorError: shared memory (or the store) could not be set up.
        """
        size = spec.tensor_parallel_size
        shared: list[SharedBuffer] = []
        try:
            io = SharedBuffer.create(io_total, "baton-step-io")
            shared.append(io)
            if size > 1:
                self._ring = StepBroadcaster(size)
                # Hosted here, so the ranks meet without racing for a free port.
                self._store = dist.TCPStore(
                    "127.0.0.1",
                    0,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=_START_TIMEOUT_S),
                )
            rank_weights = []
            for rank in range(size):
                # A callable reads one rank's shard at a time (the loader's shard mode), so the
                # whole model is never in this process at once.
                shard = (
                    weights(rank)
                    if callable(weights)
                    else shard_weights(weights, spec.model_config, rank, size)
                )
                buf, layouts, quant_layouts = _share_weights(shard, quantized)
                del shard
                shared.append(buf)
                rank_weights.append((buf, layouts, quant_layouts))
        except (OSError, RuntimeError) as exc:
            for buf in shared:
                buf.close()
            raise ExecutorError(f"cannot set up the model workers' shared memory: {exc}") from exc
        return io, rank_weights

    def _start_worker(
        self,
        spec: RunnerSpec,
        rank: int,
        buf: SharedBuffer,
        layouts: dict[str, TensorLayout],
        quant_layouts: dict[str, QuantLayout],
        io: SharedBuffer,
        io_layouts: dict[str, TensorLayout],
        prestarted: WorkerProcess | None,
    ) -> None:
        """Starts rank ``rank``'s worker process (or takes ``prestarted``), appends it to
        ``_workers``, hands it the shared buffers and sends it its ``WorkerInit``; closes this
        process's descriptor of the rank's weights.

        Raises:
            ExecutorError: the process could not be started or reached.
        """
        init = WorkerInit(
            spec=spec,
            weights_fd=buf.fd,
            weights_nbytes=buf.nbytes,
            weights=layouts,
            quantized=quant_layouts,
            io_fd=io.fd,
            io_nbytes=io.nbytes,
            bitmasks=io_layouts["bitmasks"],
            sampled=io_layouts["sampled"],
            rank=rank,
            store_port=0 if self._store is None else self._store.port,
            broadcast=None if self._ring is None else self._ring.layout,
        )
        fds = [buf.fd, io.fd] + ([] if self._ring is None else [self._ring.layout.fd])
        try:
            worker = prestarted or WorkerProcess()
        except OSError as exc:
            self.shutdown()
            raise ExecutorError(f"cannot start the model worker process: {exc}") from exc
        self._workers.append(worker)
        try:
            worker.hand_over(fds)
            worker.conn.send(init)
        except OSError:
            # A worker that is gone already (an import failure, a kill) left its reason in the
            # connection or its exit status: _wait_ready, which follows, reports that.
            pass
        # The worker holds its own copy of the descriptor now; its weights' pages live on in
        # its mapping only.
        buf.close()

    def _wait_ready(self, worker: WorkerProcess, rank: int) -> None:
        conn = worker.conn
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not conn.poll(_POLL_S):
            if not worker.is_alive():
                break  # its last message, if any, is still readable
            if time.monotonic() > deadline:
                self._start_failed(
                    f"{self._rank_name(rank)}not ready after {_START_TIMEOUT_S:.0f} s"
                )
        try:
            message = conn.recv()
        except (EOFError, OSError) as exc:
            worker.stop()
            ended = worker.exit_description() or "still running"
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._start_failed(
                f"{self._rank_name(rank)}it ended without a reason ({ended}; {reason})"
            )
        if not isinstance(message, Ready):
            self._start_failed(f"{self._rank_name(rank)}\n{failure_text(message)}")

    def _rank_name(self, rank: int) -> str:
        return f"rank {rank}: " if len(self._workers) > 1 else ""

    def _start_failed(self, reason: str) -> None:
        self.shutdown()
        raise ExecutorError(f"the model worker process failed to start: {reason}")

    @property
    def worker_pid(self) -> int:
        """The model worker's process id (rank 0's under tensor parallelism; for tests and
        monitoring)."""
        return self._workers[0].pid

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Every model worker's process id, by tensor-parallel rank."""
        return tuple(w.pid for w in self._workers)

    @property
    def collective_seconds(self) -> float:
        """Of ``device_seconds``, the time rank 0 spent in tensor-parallel collectives
        (all-reduces, the logits gather, the token broadcast; waiting for the other ranks
        included), for steps already returned; 0 without tensor parallelism."""
        return self._collective_s

    # ----------------------------------------------------------------- steps
    def execute_model(self, so: SchedulerOutput) -> None:
        message = Execute(so)
        if self._ring is None:
            self._send(self._conn, message)
            return
        seq = self._ring.publish(message)
        for worker in self._workers:
            self._send(worker.conn, message if seq is None else Rung(seq))

    def sample_tokens(self, step_id: int, grammar: GrammarOutput | None) -> AsyncOutput:
        slot = self._slot
        self._slot = (self._slot + 1) % _SLOTS
        request_ids: tuple[str, ...] = ()
        row_counts: tuple[int, ...] = ()
        if grammar is not None and grammar.request_ids:
            target = self._bitmasks[slot, : grammar.num_rows]
            if grammar.bitmask.data_ptr() != target.data_ptr():  # not filled in place
                target.copy_(grammar.bitmask[: grammar.num_rows])
            request_ids, row_counts = grammar.request_ids, grammar.row_counts
        self._send(self._conn, Sample(step_id, slot, request_ids, row_counts))
        for worker in self._workers[1:]:  # the bitmask is rank 0's only
            self._send(worker.conn, Sample(step_id, slot))
        return _MpOutput(self, step_id)

    def bitmask_buffer(self) -> torch.Tensor:
        return self._bitmasks[self._slot]

    def _send(self, conn: Connection, message: WorkerCommand) -> None:
        if self._dead is not None:
            raise ExecutorError(self._dead)
        try:
            conn.send(message)
        except (OSError, EOFError, BrokenPipeError) as exc:
            self._died(f"cannot reach the model worker process: {exc}")

    def _receive(self, step_id: int) -> ModelRunnerOutput:
        with self._checker.allow():
            while step_id not in self._replies:
                if self._dead is not None:
                    raise ExecutorError(self._dead)
                try:
                    if not self._conn.poll(_POLL_S):
                        if any(not w.is_alive() for w in self._workers):
                            self._died("the model worker process died")
                        continue
                    reply: Reply | Failed = self._conn.recv()
                except (EOFError, OSError) as exc:
                    self._died(f"the model worker process died: {type(exc).__name__} {exc}")
                if not isinstance(reply, Reply):  # a tensor-parallel step failed: fatal
                    self._died(f"the model worker process failed:\n{failure_text(reply)}")
                self._replies[reply.step_id] = reply
            reply = self._replies.pop(step_id)
            self._device_s = reply.device_seconds
            self._collective_s = reply.collective_seconds
            self._threads = reply.threads
            if reply.error is not None:  # this step's requests fail; the others go on
                return ModelRunnerOutput(
                    request_ids=list(reply.request_ids),
                    sampled_token_ids=[[] for _ in reply.request_ids],
                    errors=dict.fromkeys(reply.request_ids, reply.error),
                )
            drafts = DraftLayout.of(reply.drafts) if reply.drafts is not None else None
            n = len(reply.sample_request_ids) if drafts is None else drafts.num_rows
            tokens = self._sampled[reply.slot, :n].tolist()
        return runner_output(
            reply.request_ids,
            reply.sample_request_ids,
            tokens,
            reply.logprobs,
            drafts,
            reply.prompt_logprobs,
        )

    def _died(self, message: str) -> None:
        ended = self._ended()
        self._dead = f"{message} ({ended})" if ended is not None else message
        raise ExecutorError(self._dead)

    def _ended(self) -> str | None:
        """How the first ended worker ended (naming its rank under tensor parallelism)."""
        for rank, worker in enumerate(self._workers):
            ended = worker.exit_description()
            if ended is not None:
                return f"{self._rank_name(rank)}{ended}"
        return None

    def failure(self) -> str | None:
        if self._dead is not None:
            return self._dead
        ended = self._ended()
        if ended is not None:
            return f"the model worker exited ({ended})"
        return None

    def supports_async_scheduling(self) -> bool:
        return True

    @property
    def device_seconds(self) -> float:
        return self._device_s

    def thread_state(self) -> ThreadState | None:
        """Rank 0's thread governor, as of its last reply."""
        return self._threads

    def shutdown(self) -> None:
        self._finalizer()
        self._store = None


def _stop_all(workers: list[WorkerProcess]) -> None:
    """Stops every worker: rank 0 last, so that no rank is left waiting for it in a
    collective while the others are asked to stop."""
    for worker in reversed(workers):
        worker.stop()
