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

The set-up (shared memory, each rank's worker started, the wait until all are ready; undone if
any step fails) is ``worker_start.py``'s; ``MultiprocExecutor.start`` runs it and builds the
executor over the ``StartedWorkers`` it returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from multiprocessing.connection import Connection

import torch

from baton.engine.executor.base import AsyncOutput, Executor, ExecutorError
from baton.engine.executor.worker_process import WorkerProcess
from baton.engine.executor.worker_start import (
    POLL_S,
    SLOTS,
    StartedWorkers,
    Weights,
    start_workers,
    stop_all,
)
from baton.engine.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from baton.engine.sync_check import SyncChecker
from baton.engine.worker.build import RunnerSpec
from baton.engine.worker.cpu_threads import ThreadState
from baton.engine.worker.messages import (
    Execute,
    Failed,
    Rung,
    Sample,
    WorkerCommand,
    failure_text,
)
from baton.engine.worker.runner_values import runner_output
from baton.engine.worker.spec_decode import DraftLayout
from baton.engine.worker.worker_main import Reply
from baton.kernels.quant_formats import QuantWeight


class _MpOutput(AsyncOutput):
    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self._executor, self._step_id = executor, step_id
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._receive(self._step_id)
        return self._output


class MultiprocExecutor(Executor):
    """Runs the model runner in a worker process (one per tensor-parallel rank); every call
    returns at once.

    Built from workers already started and ready (``start``, or ``worker_start.start_workers``
    and this constructor, which starts and waits for nothing and cannot fail half way). It owns
    them from then on: ``shutdown``, or this object's collection, stops them.
    """

    def __init__(self, started: StartedWorkers, checker: SyncChecker | None = None) -> None:
        self._checker = checker or SyncChecker("off")
        self._workers = started.workers
        self._conn = started.workers[0].conn
        self._ring = started.ring
        self._store = started.store  # the ranks' meeting point, kept while they run
        self._sampled = started.sampled
        # One view per slot, made once: the manager fills the one ``bitmask_buffer`` gives and
        # knows it (and its row views) by identity from step to step.
        self._slot_masks = tuple(started.bitmasks[i] for i in range(SLOTS))
        self._slot_ptrs = tuple(m.data_ptr() for m in self._slot_masks)
        self._slot = 0
        self._device_s = 0.0
        self._collective_s = 0.0
        self._threads: ThreadState | None = None
        self._replies: dict[int, Reply] = {}
        self._dead: str | None = None
        self._finalizer = weakref.finalize(self, stop_all, self._workers)

    @classmethod
    def start(
        cls,
        spec: RunnerSpec,
        weights: Weights,
        checker: SyncChecker | None = None,
        quantized: Mapping[str, QuantWeight] | None = None,
        prestarted: WorkerProcess | None = None,
    ) -> MultiprocExecutor:
        """Starts ``spec``'s workers (``worker_start.start_workers``: shared memory, one worker
        process per tensor-parallel rank, the wait until each is ready) and returns the
        executor over them.

        ``weights``: the whole model's (cut for each rank), or a function that gives rank
        ``r``'s shard (called once per rank, in order). ``quantized``: GGUF-quantised linears
        (``spec.quantization="gguf"``, one rank only), shared with the worker beside
        ``weights``. ``prestarted``: rank 0's worker process, started earlier
        (``WorkerProcess()``) so that it imported the runner while the model was read; stopped
        if the start fails after it was taken. A failed start stops every worker it started.

        Raises:
            ExecutorError: a worker failed to start; the message says why (its traceback, or
                how it ended).
            ValueError: the model cannot be cut into ``spec.tensor_parallel_size`` shards, or
                ``quantized`` with more than one.
        """
        started = start_workers(spec, weights, quantized=quantized, prestarted=prestarted)
        return cls(started, checker)

    def _rank_name(self, rank: int) -> str:
        return f"rank {rank}: " if len(self._workers) > 1 else ""

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
        self._slot = (self._slot + 1) % SLOTS
        request_ids: tuple[str, ...] = ()
        row_counts: tuple[int, ...] = ()
        if grammar is not None and grammar.request_ids:
            if grammar.bitmask.data_ptr() != self._slot_ptrs[slot]:  # not filled in place
                n = grammar.num_rows
                self._slot_masks[slot][:n].copy_(grammar.bitmask[:n])
            request_ids, row_counts = grammar.request_ids, grammar.row_counts
        self._send(self._conn, Sample(step_id, slot, request_ids, row_counts))
        for worker in self._workers[1:]:  # the bitmask is rank 0's only
            self._send(worker.conn, Sample(step_id, slot))
        return _MpOutput(self, step_id)

    def bitmask_buffer(self) -> torch.Tensor:
        return self._slot_masks[self._slot]

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
                    if not self._conn.poll(POLL_S):
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
