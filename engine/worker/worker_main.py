"""The model worker process: builds the runner from what the engine sends, then runs its steps.

It is started as a fresh interpreter that imports this module only (never the user's
``__main__``, see ``executor/worker_process.py``). The engine sends one "init" message (the
runner spec, where the weights, bitmasks and sampled tokens lie in the inherited shared
buffers), then per step an ``Execute`` (the ``SchedulerOutput``) and a ``Sample``
(``messages.py``). Each ``Sample`` is answered with one ``Reply``, in order, from a sender
thread, so neither side can block on a full socket while the other blocks on its own send.

Under tensor parallelism there is one worker per rank: each joins the process group and builds
its shard; the engine writes each ``Execute`` once into a shared ring (``step_broadcast.py``)
and rings every rank with ``Rung(seq)``; every rank gets ``Sample``, only rank 0 gets the
grammar bitmask and answers. A failed step would leave the other ranks waiting in a collective,
so there a step failure ends the worker (the engine then fails every request with the reason).
The worker ignores SIGINT
(the engine process owns Ctrl-C) and exits when the connection closes, so it dies with the
engine process however that ends.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from baton.engine.gc_heap import freeze_startup_heap
from baton.engine.scheduler_output import (
    GrammarOutput,
    Logprobs,
    PromptLogprobs,
    SchedulerOutput,
    bitmask_rows,
)
from baton.engine.worker.build import RunnerSpec, build_runner
from baton.engine.worker.cpu_threads import ThreadGovernor, ThreadState, read_cpu
from baton.engine.worker.fd_passing import receive_fds
from baton.engine.worker.messages import (
    Execute,
    Failed,
    Ready,
    Rung,
    Sample,
    Shutdown,
    WorkerCommand,
)
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.runner_values import ForwardOutput
from baton.engine.worker.shared_memory import QuantLayout, SharedBuffer, TensorLayout
from baton.engine.worker.step_broadcast import BroadcastLayout, StepReader
from baton.engine.worker.tp_runner import join_group
from baton.engine.worker.weight_pages import WeightPageMover


@dataclass(frozen=True)
class WorkerInit:
    """The "init" message: what the worker builds and where its shared tensors lie."""

    spec: RunnerSpec
    weights_fd: int
    weights_nbytes: int
    weights: dict[str, TensorLayout]
    io_fd: int
    io_nbytes: int
    bitmasks: TensorLayout  # int32 [slots, rows, words]
    sampled: TensorLayout  # int64 [slots, rows]
    # Tensor parallelism (spec.tensor_parallel_size > 1): this worker's rank, the engine's
    # TCP store for joining the group, and the ring the steps are broadcast through.
    rank: int = 0
    store_port: int = 0
    broadcast: BroadcastLayout | None = None
    # GGUF-quantised linears (spec.quantization "gguf"), in the weights' buffer too.
    quantized: dict[str, QuantLayout] = field(default_factory=dict)

    def with_local_fds(self, fd_map: dict[int, int]) -> WorkerInit:
        """This message with the engine's descriptor numbers replaced by this process's
        (``fd_passing.receive_fds``' map). Raises KeyError for a descriptor not handed over."""
        broadcast = self.broadcast
        if broadcast is not None:
            broadcast = replace(broadcast, fd=fd_map[broadcast.fd])
        return replace(
            self, weights_fd=fd_map[self.weights_fd], io_fd=fd_map[self.io_fd], broadcast=broadcast
        )


@dataclass(frozen=True)
class Reply:
    """The worker's answer to one ``Sample``."""

    step_id: int
    slot: int
    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    logprobs: dict[str, Logprobs]
    error: str | None
    device_seconds: float = 0.0  # the worker's forward + sampling time so far
    collective_seconds: float = 0.0  # of which inside tensor-parallel collectives
    threads: ThreadState | None = None  # the thread governor's state, where there is one
    # With drafts in the step: each sampling request's drafts (its tokens fill one row each,
    # and one more); None: one token per sampling request.
    drafts: tuple[tuple[int, ...], ...] | None = None
    # Prompt logprobs of the requests whose prompt chunk delivered some this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass(frozen=True)
class _FailedStep:
    request_ids: tuple[str, ...]
    message: str


def serve(conn: Connection) -> int:
    """The worker's whole life: init, then steps until ``Shutdown`` or the connection closes.
    Returns the process exit code. A failure to start is sent as ``Failed(traceback)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fd_map = receive_fds(conn)
        if fd_map is None:
            return 0  # the engine stopped before it had anything to run
        init: WorkerInit = conn.recv().with_local_fds(fd_map)
        if init.spec.num_threads is not None:
            torch.set_num_threads(init.spec.num_threads)
        weights_mem = SharedBuffer(init.weights_fd, init.weights_nbytes)
        weights = {name: weights_mem.tensor(lay) for name, lay in init.weights.items()}
        quantized = {name: weights_mem.quant_weight(q) for name, q in init.quantized.items()}
        # moved onto huge pages once ready, while idle (weight_pages.py says why)
        mover = WeightPageMover(
            [
                (quantized[name].data, functools.partial(weights_mem.release, q.data))
                for name, q in init.quantized.items()
            ]
        )
        io = SharedBuffer(init.io_fd, init.io_nbytes)
        bitmasks, sampled = io.tensor(init.bitmasks), io.tensor(init.sampled)
        tp = None
        reader = None
        if init.spec.tensor_parallel_size > 1:
            size = init.spec.tensor_parallel_size
            tp = join_group(init.rank, size, init.store_port, init.spec.device)
            if init.broadcast is not None:
                reader = StepReader(init.broadcast, init.rank)
        runner = build_runner(init.spec, weights, tp, quantized)
        weights_mem.close()
        io.close()
        del weights, quantized
        freeze_startup_heap()  # this process's step loop runs for its whole life
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send(Failed(traceback.format_exc()))
        return 1
    conn.send(Ready())
    try:
        governor = None
        if init.spec.adapt_threads:  # set only for device "cpu"
            # The engine process's host work overlaps this worker's forwards by design; on the
            # default model's tiny twin (bench engine, regime b) it measured 0.5-0.7 of a core,
            # and dropping a thread for it was slower than sharing. Only others count.
            parent = (os.getppid(),)
            governor = ThreadGovernor(read=lambda: read_cpu(partners=parent))
        _run_steps(conn, runner, bitmasks, sampled, reader, init.rank == 0, governor, mover)
    except Exception:  # noqa: BLE001 - a tensor-parallel step failed: reported, then exit
        conn.send(Failed(traceback.format_exc()))
        return 1
    return 0


def _run_steps(
    conn: Connection,
    runner: ModelRunner,
    bitmasks: torch.Tensor,
    sampled: torch.Tensor,
    reader: StepReader | None = None,
    driver: bool = True,
    governor: ThreadGovernor | None = None,
    mover: WeightPageMover | None = None,
) -> None:
    """Serves steps until ``Shutdown`` or the connection closes. With tensor parallelism
    (``runner.model.tp`` set) a failed step raises instead of failing its requests: the other
    ranks could not go on without this one. ``governor`` adjusts the torch threads before
    each forward. ``mover``'s weights move a slice at a time while no message waits (between
    messages: no step is running)."""
    tp = runner.model.tp
    outbox: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_replies, args=(conn, outbox), daemon=True)
    sender.start()
    pending: deque[ForwardOutput | _FailedStep] = deque()
    busy = 0.0
    try:
        while True:
            try:
                while mover is not None and mover.pending and not conn.poll(0):
                    mover.move_slice()
                message: WorkerCommand = conn.recv()
            except (EOFError, OSError):
                break  # the engine is gone
            if isinstance(message, Rung) and reader is not None:
                message = reader.read(message.seq)
            t0 = time.perf_counter()
            if isinstance(message, Execute):
                so: SchedulerOutput = message.so
                if governor is not None:
                    governor.before_step()
                try:
                    pending.append(runner.execute_model(so))
                except Exception:  # noqa: BLE001 - fails this step's requests, not the worker
                    if tp is not None:
                        raise
                    text = f"model step failed:\n{traceback.format_exc()}"
                    pending.append(_FailedStep(tuple(so.num_scheduled_tokens), text))
                busy += time.perf_counter() - t0
            elif isinstance(message, Sample):
                step_id, slot = message.step_id, message.slot
                grammar_ids, row_counts = message.grammar_ids, message.row_counts
                out = sampled if driver else None
                grammar = None
                if grammar_ids:  # the bitmask lies in the slot's shared buffer
                    n = bitmask_rows(grammar_ids, row_counts)
                    grammar = GrammarOutput(grammar_ids, bitmasks[slot, :n], row_counts)
                reply = _sample(runner, pending, step_id, slot, grammar, out)
                busy += time.perf_counter() - t0
                if tp is not None and reply.error is not None:
                    raise RuntimeError(reply.error)
                if driver:
                    comm = 0.0 if tp is None else tp.collective_seconds
                    threads = governor.state() if governor is not None else None
                    outbox.put(
                        replace(
                            reply, device_seconds=busy, collective_seconds=comm, threads=threads
                        )
                    )
            elif isinstance(message, Shutdown):
                break
    finally:
        outbox.put(None)
        sender.join(timeout=5)


def _send_replies(conn: Connection, outbox: queue.SimpleQueue[Reply | None]) -> None:
    while (reply := outbox.get()) is not None:
        try:
            conn.send(reply)
        except (OSError, EOFError, BrokenPipeError):
            return


def _sample(
    runner: Any,
    pending: deque[ForwardOutput | _FailedStep],
    step_id: int,
    slot: int,
    grammar: GrammarOutput | None,
    sampled: torch.Tensor | None,
) -> Reply:
    """Samples the oldest executed step with ``grammar``; its tokens go to ``sampled[slot]``
    (None: nowhere, on the tensor-parallel ranks other than 0)."""
    fwd = pending.popleft() if pending else _FailedStep((), "sample_tokens without a forward")
    if isinstance(fwd, _FailedStep):
        return Reply(step_id, slot, fwd.request_ids, (), {}, fwd.message)
    try:
        s = runner.sample(fwd, grammar)
        if sampled is not None:
            sampled[slot, : s.token_ids.numel()].copy_(s.token_ids)
    except Exception:  # noqa: BLE001 - fails this step's requests, not the worker
        message = f"sampling failed:\n{traceback.format_exc()}"
        return Reply(step_id, slot, fwd.request_ids, (), {}, message)
    drafts = s.drafts.drafts if s.drafts is not None else None
    return Reply(
        step_id,
        slot,
        s.request_ids,
        s.sample_request_ids,
        s.logprobs,
        None,
        drafts=drafts,
        prompt_logprobs=s.prompt_logprob_parts,
    )
