"""Starting the model workers of ``MultiprocExecutor``: shared memory, one worker process per
tensor-parallel rank, the wait for each to be ready.

``start_workers`` does all of it and returns a ``StartedWorkers`` (the ready workers and what
the engine side keeps: the bitmask and sampled-token tensors in the step I/O buffer, the step
ring, the TCP store); the executor is built from that value and starts nothing itself. A start
that fails half way stops every worker it started (rank 0's ``prestarted`` one included) and
closes every buffer it made before it raises.

Each rank's weights are copied into a shared buffer of their own (the dense ones and GGUF-
quantised ones' packed bytes), whose descriptor the worker inherits over its socket
(``WorkerProcess.hand_over``) with its ``WorkerInit``; this process closes its descriptors and
drops its mappings once every worker has them, so the weights' pages live on in the workers'
mappings only. With several ranks the steps go through a shared ring (``step_broadcast.py``)
and the ranks meet through a TCP store hosted here on loopback.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from baton.engine.executor.base import ExecutorError
from baton.engine.executor.worker_process import WorkerProcess
from baton.engine.models.sharding import check_tensor_parallel, shard_weights
from baton.engine.worker.build import RunnerSpec
from baton.engine.worker.messages import Ready, failure_text
from baton.engine.worker.shared_memory import (
    QuantLayout,
    SharedBuffer,
    TensorLayout,
    pack_layouts,
)
from baton.engine.worker.step_broadcast import StepBroadcaster
from baton.engine.worker.worker_main import WorkerInit
from baton.grammar.backend import bitmask_width
from baton.kernels.quant_formats import QuantWeight

SLOTS = 2  # steps in flight at most (max_concurrent_batches): bitmask and token buffers each
_START_TIMEOUT_S = 300.0
POLL_S = 0.5  # seconds between looks at whether a worker waited on still lives
# Prefix of a quantised weight's bytes among the shared buffer's layouts (no dense weight
# name has a colon).
_QUANT_PREFIX = "quant:"

Weights = dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class StartedWorkers:
    """Every rank's worker process, each ready (its ``Ready`` read), and what the engine keeps
    of the set-up: the engine's views of the step I/O buffer and, with several ranks, the step
    ring and the TCP store the ranks met through (kept alive for as long as the workers run).

    Raises:
        ValueError: no workers.
    """

    workers: tuple[WorkerProcess, ...]  # by tensor-parallel rank
    bitmasks: torch.Tensor  # int32 [SLOTS, rows, words], filled with -1 (allow all)
    sampled: torch.Tensor  # int64 [SLOTS, rows]
    ring: StepBroadcaster | None = None
    store: dist.TCPStore | None = None

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("StartedWorkers needs at least one worker")


@dataclass
class _Shared:
    """What ``_share_memory`` made, owned by one ``start_workers`` call: the step I/O buffer,
    each rank's weights buffer and layouts, and with several ranks the ring and store."""

    io: SharedBuffer
    io_layouts: dict[str, TensorLayout]
    ranks: list[tuple[SharedBuffer, dict[str, TensorLayout], dict[str, QuantLayout]]]
    ring: StepBroadcaster | None = None
    store: dist.TCPStore | None = None
    made: list[SharedBuffer] = field(default_factory=list)

    def close(self) -> None:
        """Closes this process's descriptors (the workers have theirs) and drops the weights'
        buffers, unmapping them here; idempotent. The I/O views and the ring stay mapped."""
        for buf in self.made:
            buf.close()
        if self.ring is not None:
            self.ring.close()
        self.made.clear()
        self.ranks.clear()


def start_workers(
    spec: RunnerSpec,
    weights: Weights,
    *,
    quantized: Mapping[str, QuantWeight] | None = None,
    prestarted: WorkerProcess | None = None,
) -> StartedWorkers:
    """Shares the weights and step buffers, starts one worker process per tensor-parallel rank
    and waits until each has built its runner.

    ``weights``: the whole model's (cut here for each rank), or a function that gives rank
    ``r``'s shard (called once per rank, in order). ``quantized``: GGUF-quantised linears
    (``spec.quantization="gguf"``, one rank only), shared beside ``weights``. ``prestarted``:
    rank 0's worker process, started earlier (``WorkerProcess()``) so that it imported the
    runner while the model was read; stopped here if the start fails after this takes it.

    On failure every worker started here is stopped (rank 0 last) and every buffer closed.

    Raises:
        ExecutorError: shared memory could not be set up, or a worker failed to start; the
            message says why (its traceback, or how it ended).
        ValueError: the model cannot be cut into ``spec.tensor_parallel_size`` shards, or
            ``quantized`` with more than one.
    """
    size = spec.tensor_parallel_size
    check_tensor_parallel(spec.model_config, size)
    if quantized and size > 1:
        raise ValueError(
            f"GGUF-quantised weights cannot be cut into {size} tensor-parallel shards yet"
        )
    shared = _share_memory(spec, weights, quantized)
    workers: list[WorkerProcess] = []
    try:
        bitmasks = shared.io.tensor(shared.io_layouts["bitmasks"])
        bitmasks.fill_(-1)
        sampled = shared.io.tensor(shared.io_layouts["sampled"])
        for rank in range(size):
            worker = prestarted if rank == 0 and prestarted is not None else _new_worker()
            workers.append(worker)
            _hand_over(worker, spec, rank, shared)
        shared.close()  # before the wait: the weights' pages live on in the workers only
        for rank, worker in enumerate(workers):
            _wait_ready(worker, f"rank {rank}: " if size > 1 else "")
    except BaseException:
        stop_all(workers)
        shared.close()
        shared.store = None  # no rank will join: its port closes
        raise
    return StartedWorkers(tuple(workers), bitmasks, sampled, shared.ring, shared.store)


def stop_all(workers: tuple[WorkerProcess, ...] | list[WorkerProcess]) -> None:
    """Stops every worker: rank 0 last, so that no rank is left waiting for it in a
    collective while the others are asked to stop."""
    for worker in reversed(workers):
        worker.stop()


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
            "bitmasks": (torch.int32, (SLOTS, rows, bitmask_width(spec.model_config.vocab_size))),
            "sampled": (torch.int64, (SLOTS, rows)),
        }
    )


def _share_memory(
    spec: RunnerSpec, weights: Weights, quantized: Mapping[str, QuantWeight] | None
) -> _Shared:
    """The step I/O buffer and each rank's weights in a shared buffer of its own; with
    several ranks also the step ring and the TCP store they meet through. Closes what it made
    before raising.

    Raises:
        ExecutorError: shared memory (or the store) could not be set up.
    """
    size = spec.tensor_parallel_size
    io_layouts, io_total = _step_io_layouts(spec)
    made: list[SharedBuffer] = []
    ring, store = None, None
    try:
        io = SharedBuffer.create(io_total, "baton-step-io")
        made.append(io)
        if size > 1:
            ring = StepBroadcaster(size)
            # Hosted here, so the ranks meet without racing for a free port.
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=_START_TIMEOUT_S),
            )
        ranks = []
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
            made.append(buf)
            ranks.append((buf, layouts, quant_layouts))
    except BaseException as exc:
        for buf in made:
            buf.close()
        if ring is not None:
            ring.close()
        store = None  # its port closes now, not when the traceback goes
        if isinstance(exc, (OSError, RuntimeError)):
            raise ExecutorError(f"cannot set up the model workers' shared memory: {exc}") from exc
        raise  # e.g. a shard that cannot be read (the loader's error)
    return _Shared(io, io_layouts, ranks, ring, store, made)


def _new_worker() -> WorkerProcess:
    """A fresh worker process.

    Raises:
        ExecutorError: the process could not be started.
    """
    try:
        return WorkerProcess()
    except OSError as exc:
        raise ExecutorError(f"cannot start the model worker process: {exc}") from exc


def _hand_over(worker: WorkerProcess, spec: RunnerSpec, rank: int, shared: _Shared) -> None:
    """Hands rank ``rank``'s ``worker`` the shared buffers and sends it its ``WorkerInit``;
    closes this process's descriptor of the rank's weights. A worker that cannot be reached
    is left for ``_wait_ready`` to report."""
    buf, layouts, quant_layouts = shared.ranks[rank]
    io, ring, store = shared.io, shared.ring, shared.store
    init = WorkerInit(
        spec=spec,
        weights_fd=buf.fd,
        weights_nbytes=buf.nbytes,
        weights=layouts,
        quantized=quant_layouts,
        io_fd=io.fd,
        io_nbytes=io.nbytes,
        bitmasks=shared.io_layouts["bitmasks"],
        sampled=shared.io_layouts["sampled"],
        rank=rank,
        store_port=0 if store is None else store.port,
        broadcast=None if ring is None else ring.layout,
    )
    fds = [buf.fd, io.fd] + ([] if ring is None else [ring.layout.fd])
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


def _wait_ready(worker: WorkerProcess, rank_name: str) -> None:
    """Waits for ``worker``'s ``Ready``. ``rank_name``: "rank r: " under tensor parallelism,
    else empty, to begin the reason with.

    Raises:
        ExecutorError: it failed to build (its traceback), ended (how), or was not ready
            within ``_START_TIMEOUT_S``.
    """
    conn = worker.conn
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not conn.poll(POLL_S):
        if not worker.is_alive():
            break  # its last message, if any, is still readable
        if time.monotonic() > deadline:
            _start_failed(f"{rank_name}not ready after {_START_TIMEOUT_S:.0f} s")
    try:
        message = conn.recv()
    except (EOFError, OSError) as exc:
        worker.stop()
        ended = worker.exit_description() or "still running"
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        _start_failed(f"{rank_name}it ended without a reason ({ended}; {reason})")
    if not isinstance(message, Ready):
        _start_failed(f"{rank_name}\n{failure_text(message)}")


def _start_failed(reason: str) -> NoReturn:
    raise ExecutorError(f"the model worker process failed to start: {reason}")
