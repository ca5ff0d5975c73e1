"""``DataParallelLLM``: one asyncio front end over N engine replicas, each a Ray actor.

Each replica (``dp_replica.EngineReplica``) is a whole engine in its own Ray worker process:
its own model, scheduler and grammar cache. The front end routes each request
(``dp_router.ReplicaRouter``: by outstanding tokens, and requests with the same grammar to
the replica that compiled it) and streams the replica's outputs back. It offers what the
OpenAI server uses of ``AsyncLLM`` (``add_request``, ``generate``, ``abort``, ``stats``,
``is_healthy``, ``get_tokenizer``, ``model_architecture``, ``sampling_defaults``,
``max_model_len``, ``shutdown``) plus ``replica_stats`` for per-replica health and metrics.

Faults: a replica that dies fails only the requests it was serving. A request that had not
received any output yet is sent once more, to another replica; one that had is failed with
``EngineDeadError`` naming the replica. Ray restarts the dead actor (``max_restarts``); a
monitor thread marks it healthy again once it answers, and routing resumes.

Ray is imported only when a ``DataParallelLLM`` is built (``pip install 'baton[ray]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from baton.engine.config import EngineConfig, num_cpu_cores
from baton.engine.entrypoints.async_llm import EngineDeadError, Prompt
from baton.engine.entrypoints.dp_config import DataParallelConfig
from baton.engine.entrypoints.dp_replica import EngineReplica
from baton.engine.entrypoints.dp_router import NoReplicaError, ReplicaRouter, Route
from baton.engine.entrypoints.output_slot import OutputSlot
from baton.engine.loader import load_tokenizer
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A request without max_tokens is counted as this many generated tokens when routing.
_UNBOUNDED_COST = 512
_MONITOR_PERIOD_S = 0.5
# stats() sums the replicas' numbers (counters, loads, seconds), except these: fractions
# and rates are averaged, settings are taken from the first replica, and the per-replica
# identity keys are left to replica_stats().
_AVERAGED = (
    "device_busy_fraction",
    "kv_usage",
    "spec_acceptance_rate",
    "spec_draft_depth",
    "spec_step_fixed_ms",
    "spec_step_row_ms",
)
_SETTINGS = ("tensor_parallel_size", "cpu_max_threads")
_PER_REPLICA = ("pid", "healthy")


def grammar_key(params: SamplingParams) -> tuple[object, ...] | None:
    """What identifies a request's compiled grammar across replicas (None: no grammar)."""
    spec = params.structured_outputs
    if spec is None:
        return None
    return (spec.backend, spec.kind, spec.spec_text, spec.options_key)


def merge_stats(
    snapshots: list[dict[str, float | int | str]],
) -> dict[str, float | int | str]:
    """Replicas' ``stats()`` as one engine's: numbers summed key by key (counters, loads,
    seconds), fractions and rates averaged, settings and strings from the first replica;
    ``pid`` and ``healthy`` left out (they are per replica)."""
    total: dict[str, float | int | str] = {}
    for snap in snapshots:
        for key, value in snap.items():
            if key in _PER_REPLICA:
                continue
            if isinstance(value, (str, bool)) or key in _SETTINGS:
                total.setdefault(key, value)
            else:
                previous = total.get(key, 0)
                total[key] = (previous if not isinstance(previous, str) else 0) + value
    for key in _AVERAGED:
        value = total.get(key)
        if isinstance(value, (int, float)) and snapshots:
            total[key] = value / len(snapshots)
    return total


def request_cost(prompt: Prompt, params: SamplingParams) -> int:
    """The tokens a request adds to its replica's load: its prompt (a text's length / 4, not
    tokenised twice) plus ``n`` times its ``max_tokens``."""
    prompt_tokens = len(prompt) // 4 + 1 if isinstance(prompt, str) else len(prompt)
    new = params.max_tokens if params.max_tokens is not None else _UNBOUNDED_COST
    return prompt_tokens + params.n * new


class DataParallelLLM:
    """Serves requests over ``dp.size`` engine replicas on Ray (see the module docs).

    Args:
        config: every replica's engine configuration.
        dp: how many replicas, where, and how to route.

    The constructor blocks until every replica has built its engine.

    Raises:
        ImportError: Ray is not installed (with the command that installs it).
        EngineDeadError: a replica failed to start (its reason included).
    """

    def __init__(self, config: EngineConfig, dp: DataParallelConfig) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                "data parallelism runs on Ray, which is not installed: "
                "pip install 'baton[ray]' (or pip install ray)"
            ) from exc
        self._ray = ray
        self.config = config
        self.dp = dp
        # First, and here: a model that cannot be read fails before any replica starts.
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        self._started_ray = False
        if not ray.is_initialized():
            # The cores this process may run on, not the machine's: under an affinity mask
            # (taskset, a container's cpuset) Ray would otherwise place replicas on cores that
            # are not there.
            cores = num_cpu_cores()
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if dp.ray_address is None:
                kwargs.update(num_cpus=cores, object_store_memory=256 << 20)
            ray.init(address=dp.ray_address, **kwargs)
            self._started_ray = True
        cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
        cpus = dp.cpus_per_replica or max(1, cluster_cpus // dp.size)
        actor = ray.remote(EngineReplica)
        self._actors = [
            actor.options(num_cpus=cpus, max_restarts=dp.max_restarts, max_task_retries=0).remote(
                config, cpus, i
            )
            for i in range(dp.size)
        ]
        infos: list[dict[str, Any]] = []
        for i, a in enumerate(self._actors):
            try:
                infos.append(ray.get(a.info.remote()))
            except ray.exceptions.RayError as exc:
                self._kill_all()
                if self._started_ray:
                    ray.shutdown()
                raise EngineDeadError(f"data-parallel replica {i} failed to start: {exc}") from None
        self.max_model_len: int = int(infos[0]["max_model_len"])
        self._sampling_defaults: dict[str, float | int] = dict(infos[0]["sampling_defaults"])
        self._architecture: str | None = infos[0]["architecture"]
        self._pids = [int(info["pid"]) for info in infos]
        self._restarts = [0] * dp.size
        self._router = ReplicaRouter(dp.size, dp.balance_tokens, dp.grammar_affinity)
        # The router is shared by the event loop (routing) and the monitor thread (health).
        self._lock = threading.Lock()
        self._snapshots: list[dict[str, float | int | str]] = [{} for _ in range(dp.size)]
        self._retried = 0
        self._ids = itertools.count()
        self._closed = threading.Event()
        # Per replica: the streams of the requests it serves, by request id (the pump thread
        # delivers to them; the event loop adds and removes them).
        self._streams: list[dict[str, ReplicaStream]] = [{} for _ in range(dp.size)]
        self._monitor = threading.Thread(target=self._watch, name="baton-dp-monitor", daemon=True)
        self._monitor.start()
        self._pumps = [
            threading.Thread(target=self._pump, args=(i,), name=f"baton-dp-pump-{i}", daemon=True)
            for i in range(dp.size)
        ]
        for pump in self._pumps:
            pump.start()
        logger.info(
            "data parallel: %d replicas on Ray, %d CPUs each, grammar affinity %s",
            dp.size,
            cpus,
            "on" if dp.grammar_affinity else "off",
        )

    # ---------------------------------------------------------------- public
    async def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> ReplicaStream:
        """Routes and queues a request on a replica; returns its output stream.

        Raises:
            ValueError: bad prompt or parameters (the replica's message; nothing is queued).
            EngineBusyError: the replica's grammar compile queue is full.
            EngineDeadError: no replica can take it.
        """
        if self._closed.is_set():
            raise EngineDeadError("the engine has stopped: it was shut down")
        if request_id is None:
            request_id = f"dp-{next(self._ids)}"
        stream = ReplicaStream(self, request_id, prompt, params)
        await stream.start()
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's cumulative outputs, like ``AsyncLLM.generate``."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (loaded in this process; the same as every replica's)."""
        return self.tokenizer

    def model_architecture(self) -> str | None:
        """The model's architecture (every replica's; ``AsyncLLM.model_architecture``)."""
        return self._architecture

    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's sampling defaults (a copy)."""
        return dict(self._sampling_defaults)

    def stats(self) -> dict[str, float | int | str]:
        """The healthy replicas' last ``stats()`` merged (``merge_stats``), plus the ``dp_*``
        routing counters: replicas, healthy replicas, affinity hits / misses / new grammars,
        requests retried on another replica."""
        with self._lock:
            snapshots = [s for i, s in enumerate(self._snapshots) if self._router.healthy(i) and s]
            counts = dict(self._router.affinity_counts)
            healthy = sum(self._router.healthy(i) for i in range(self.dp.size))
            retried = self._retried
        total = merge_stats(snapshots)
        total.update(
            dp_size=self.dp.size,
            dp_healthy_replicas=healthy,
            dp_affinity_hit=counts["hit"],
            dp_affinity_miss=counts["miss"],
            dp_affinity_new=counts["new"],
            dp_retried_requests=retried,
        )
        return total

    def replica_stats(self) -> list[dict[str, float | int | str]]:
        """Per replica: index, healthy (1/0), pid, restarts, requests routed, outstanding
        tokens, and its engine's running/waiting requests and grammar compiles."""
        with self._lock:
            rows: list[dict[str, float | int | str]] = []
            for i, snap in enumerate(self._snapshots):
                rows.append(
                    {
                        "replica": i,
                        "healthy": int(self._router.healthy(i)),
                        "pid": self._pids[i],
                        "restarts": self._restarts[i],
                        "routed": self._router.routed[i],
                        "load_tokens": self._router.load(i),
                        "num_running": snap.get("num_running", 0),
                        "num_waiting": snap.get("num_waiting", 0),
                        "grammar_compiles": snap.get("grammar_compiles", 0),
                        "grammar_cache_entries": snap.get("grammar_cache_entries", 0),
                    }
                )
            return rows

    def is_healthy(self) -> bool:
        """True while at least one replica can serve."""
        if self._closed.is_set():
            return False
        with self._lock:
            return any(self._router.healthy(i) for i in range(self.dp.size))

    def replica_pid(self, replica: int) -> int:
        """The process id of a replica's actor (as of its last answer)."""
        with self._lock:
            return self._pids[replica]

    async def abort(self, request_id: str) -> None:
        """Aborts a request on every replica (ids are unique; unknown ones are ignored)."""
        for a in self._actors:
            a.abort.remote(request_id)

    def shutdown(self) -> None:
        """Stops the monitor and every replica, and the Ray instance this started; open
        streams fail with ``EngineDeadError``. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._monitor.join(5)
        for i in range(self.dp.size):
            self._fail_streams(i, EngineDeadError("the engine has stopped: it was shut down"))
        for a in self._actors:
            # A dead replica has nothing to shut down.
            with contextlib.suppress(Exception):
                self._ray.get(a.shutdown.remote(), timeout=10)
        self._kill_all()
        for pump in self._pumps:
            pump.join(5)
        if self._started_ray:
            self._ray.shutdown()

    # ------------------------------------------------------------- internals
    def route(self, prompt: Prompt, params: SamplingParams) -> tuple[Route, int]:
        """The replica for a request and its cost (added to that replica's load)."""
        cost = request_cost(prompt, params)
        with self._lock:
            try:
                return self._router.route(grammar_key(params), cost), cost
            except NoReplicaError as exc:
                raise EngineDeadError(str(exc)) from None

    def release(self, replica: int, cost: int) -> None:
        """Gives a request's cost back to its replica's load."""
        with self._lock:
            self._router.done(replica, cost)

    def replica_failed(self, replica: int, error: BaseException) -> None:
        """Takes a replica out of routing until the monitor hears from it again."""
        with self._lock:
            was = self._router.healthy(replica)
            self._router.set_healthy(replica, False)
        if was:
            logger.warning("data-parallel replica %d failed: %s", replica, _first_line(error))

    def count_retry(self) -> None:
        """Counts a request sent again to another replica."""
        with self._lock:
            self._retried += 1

    def actor(self, replica: int) -> Any:
        """The Ray actor handle of a replica."""
        return self._actors[replica]

    def attach(self, replica: int, stream: ReplicaStream) -> None:
        """Routes ``replica``'s outputs for ``stream.request_id`` to ``stream``."""
        with self._lock:
            self._streams[replica][stream.request_id] = stream

    def detach(self, replica: int, request_id: str) -> None:
        """Stops routing ``replica``'s outputs for ``request_id``."""
        with self._lock:
            self._streams[replica].pop(request_id, None)

    def _pump(self, replica: int) -> None:
        """Reads ``replica``'s output batches for as long as this runs and hands each output to
        its request's stream. When the replica dies, its streams get the error; reading
        resumes once the monitor has seen the restarted replica answer."""
        ray = self._ray
        while not self._closed.is_set():
            gen = self._actors[replica].outputs.options(num_returns="streaming").remote()
            try:
                for ref in gen:
                    batch = ray.get(ref)
                    with self._lock:
                        streams = self._streams[replica]
                        targets = [(streams.get(rid), item) for rid, item in batch.items()]
                    for stream, item in targets:
                        if stream is not None:
                            stream.deliver(item)
            except ray.exceptions.RayError as exc:
                if self._closed.is_set():
                    return
                self.replica_failed(replica, exc)
                self._fail_streams(replica, _ReplicaDied(replica, exc))
                while not self._closed.wait(0.2):
                    with self._lock:
                        if self._router.healthy(replica):
                            break

    def _fail_streams(self, replica: int, error: BaseException) -> None:
        with self._lock:
            streams, self._streams[replica] = self._streams[replica], {}
        for stream in streams.values():
            stream.deliver(error)

    def _watch(self) -> None:
        """Polls every replica's stats; a replica that fails to answer is taken out of
        routing, one that answers again (Ray restarted it) is put back."""
        ray = self._ray
        pending: dict[int, Any] = {}
        while not self._closed.wait(_MONITOR_PERIOD_S):
            for i, a in enumerate(self._actors):
                if i not in pending:
                    pending[i] = a.stats.remote()
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
            ready_set = set(ready)
            for i in list(pending):
                ref = pending[i]
                if ref not in ready_set:
                    continue
                del pending[i]
                try:
                    snap = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    self.replica_failed(i, exc)
                    continue
                self._update(i, snap)

    def _update(self, replica: int, snap: dict[str, float | int | str]) -> None:
        with self._lock:
            pid = int(snap.get("pid", 0))
            restarted = pid != self._pids[replica]
            if restarted:
                self._pids[replica] = pid
                self._restarts[replica] += 1
            self._snapshots[replica] = snap
            up = bool(snap.get("healthy", 0))
            was = self._router.healthy(replica)
            if restarted or up != was:
                self._router.set_healthy(replica, up)
        if up and not was:
            logger.info("data-parallel replica %d is serving again (pid %d)", replica, pid)

    def _kill_all(self) -> None:
        for a in self._actors:
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(a, no_restart=True)


class _ReplicaDied(Exception):
    """Delivered to a stream whose replica died: it moves or fails (``ReplicaStream``)."""

    def __init__(self, replica: int, cause: BaseException) -> None:
        super().__init__(f"data-parallel replica {replica} died: {_first_line(cause)}")
        self.replica = replica


class ReplicaStream:
    """The outputs of one request served by a replica; the ``RequestStream`` interface
    (``async for``, ``finished``, ``close``). The owner's pump thread delivers outputs; when
    the consumer is slower, outputs merge (each is cumulative). A replica that dies before the
    request's first output is replaced once by another; after it, iteration raises
    ``EngineDeadError`` naming the replica."""

    def __init__(
        self, owner: DataParallelLLM, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> None:
        self.request_id = request_id
        self._owner = owner
        self._prompt = prompt
        self._params = params
        self._slot: OutputSlot | None = None  # made in ``start``, on the consumer's loop
        self._replica = -1
        self._cost = 0
        self._received = False
        self._retried = False
        self._finished = False
        self._closed = False

    @property
    def finished(self) -> bool:
        """True once the final output has been handed to the consumer."""
        return self._finished

    @property
    def replica(self) -> int:
        """The replica serving the request."""
        return self._replica

    async def start(self) -> None:
        """Routes the request and queues it on a replica, moving on to another while the one
        picked turns out dead (each is marked unhealthy).

        Raises:
            ValueError / EngineBusyError: the replica refused the request.
            EngineDeadError: no replica could take it.
        """
        import ray  # installed: the owner could not exist without it

        if self._slot is None:
            self._slot = OutputSlot(asyncio.get_running_loop())
        while True:
            route, cost = self._owner.route(self._prompt, self._params)
            self._replica, self._cost = route.replica, cost
            # Attached first: the replica may answer before ``add`` returns here.
            self._owner.attach(route.replica, self)
            try:
                await self._owner.actor(route.replica).add.remote(
                    self._prompt, self._params, self.request_id
                )
            except ray.exceptions.RayTaskError as exc:
                self._detach()
                raise _cause(exc) from None
            except ray.exceptions.RayError as exc:
                self._detach()
                self._owner.replica_failed(route.replica, exc)
                continue
            except BaseException:
                # Cancelled while adding: the add may still land; abort it behind the add.
                self._owner.actor(route.replica).abort.remote(self.request_id)
                self._detach()
                raise
            return

    # Pump-thread side.
    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Hands an output or an error to the consumer's loop (from the pump thread)."""
        if self._slot is not None:
            self._slot.offer(item)

    # Consumer side.
    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        assert self._slot is not None, "start() first"
        while True:
            try:
                out = await self._slot.take()
            except _ReplicaDied as died:
                if died.replica != self._replica:
                    continue  # from a replica this request already left
                if self._received or self._retried:
                    self._end()
                    raise EngineDeadError(f"{died}; it was serving the request") from None
                self._retried = True
                self._release()
                self._owner.count_retry()
                await self.start()
                logger.info(
                    "request %s: replica %d died before its first output; sent to replica %d",
                    self.request_id,
                    died.replica,
                    self._replica,
                )
                continue
            except Exception:  # the replica's own error ends the stream
                self._end()
                raise
            self._received = True
            if out.finished:
                self._end()
            return out

    def close(self) -> None:
        """Aborts the request on its replica unless it has finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._finished and self._replica >= 0:
            self._owner.actor(self._replica).abort.remote(self.request_id)
            self._detach()

    def _end(self) -> None:
        self._finished = True
        self._detach()

    def _detach(self) -> None:
        self._owner.detach(self._replica, self.request_id)
        self._release()

    def _release(self) -> None:
        if self._cost:
            self._owner.release(self._replica, self._cost)
            self._cost = 0


def _cause(exc: BaseException) -> BaseException:
    """The replica's own exception inside a Ray task error (its type and message)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
