"""``EngineReplica``: one data-parallel replica, the body of a Ray actor.

It owns one ``AsyncLLM`` (its own engine thread, model and grammar cache) and serves it over
Ray: ``add`` validates and queues a request, ``outputs`` yields every request's outputs in
batches (a Ray streaming generator the front end reads for the replica's lifetime), ``abort``
ends one. Ray is not imported here: ``DataParallelLLM`` wraps the class
with ``ray.remote`` where Ray is installed, so this module imports without it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import torch

from baton.engine.config import EngineConfig
from baton.engine.entrypoints.async_llm import AsyncLLM, Prompt, RequestStream
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import SamplingParams


class EngineReplica:
    """One engine inside a Ray actor process.

    Outputs leave in batches: every request's newest output since the last batch, keyed by
    request id, from one long-lived ``outputs`` stream the front end reads. One Ray item per
    batch, not per token and request, is what keeps Ray's per-item cost off the step rate.

    Args:
        config: the engine's configuration (the same for every replica).
        threads: torch threads of this replica (Ray sets OMP_NUM_THREADS from the actor's
            CPUs; this makes it explicit, for the in-process model).
        index: the replica's index (for messages).

    Raises:
        whatever ``AsyncLLM`` raises while building the engine (the actor fails to start).
    """

    def __init__(self, config: EngineConfig, threads: int, index: int) -> None:
        torch.set_num_threads(threads)
        self.index = index
        self._engine = AsyncLLM(config)
        self._forwarders: dict[str, asyncio.Task[None]] = {}
        # Newest output (cumulative, so it stands for the ones before it) or the error that
        # ended the stream, per request, since the last batch went out.
        self._pending: dict[str, RequestOutput | BaseException] = {}
        self._wake: asyncio.Event | None = None  # made on the actor's loop, at first use
        self._reader = 0  # the newest ``outputs`` call; an older one ends

    def info(self) -> dict[str, Any]:
        """What the front end needs from a replica: its pid and model limits; also the
        readiness probe after a restart."""
        return {
            "pid": os.getpid(),
            "max_model_len": self._engine.max_model_len,
            "sampling_defaults": self._engine.sampling_defaults(),
            "architecture": self._engine.model_architecture(),
        }

    async def add(self, prompt: Prompt, params: SamplingParams, request_id: str) -> None:
        """Validates and queues a request (``AsyncLLM.add_request``'s errors, as they are);
        its outputs go out through ``outputs``."""
        if request_id in self._forwarders:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = await self._engine.add_request(prompt, params, request_id)
        self._forwarders[request_id] = asyncio.ensure_future(self._forward(request_id, stream))

    async def outputs(self) -> AsyncIterator[dict[str, RequestOutput | BaseException]]:
        """Yields, whenever there is any, a batch: each request's newest output (or the error
        that ended it) since the last batch. Runs until the actor stops, or until a newer call
        takes over (the front end re-subscribing after losing its connection), so that no
        batch goes to a reader nobody listens to."""
        self._reader += 1
        me = self._reader
        wake = self._event()
        wake.set()  # whatever is pending goes to the new reader at once
        while True:
            await wake.wait()
            if self._reader != me:
                return
            wake.clear()
            batch, self._pending = self._pending, {}
            if batch:
                yield batch

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its final output still goes out); unknown ids are ignored."""
        await self._engine.abort(request_id)

    async def _forward(self, request_id: str, stream: RequestStream) -> None:
        wake = self._event()
        try:
            async for out in stream:
                self._pending[request_id] = out
                wake.set()
        except Exception as exc:  # noqa: BLE001 - the front end's to raise (e.g. engine dead)
            self._pending[request_id] = exc
            wake.set()
        finally:
            self._forwarders.pop(request_id, None)
            stream.close()

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def stats(self) -> dict[str, float | int | str]:
        """The engine's ``stats()``, plus ``healthy`` (1/0) and ``pid``."""
        stats = self._engine.stats()
        stats["healthy"] = int(self._engine.is_healthy())
        stats["pid"] = os.getpid()
        return stats

    def shutdown(self) -> None:
        """Stops the engine (its open streams fail)."""
        self._engine.shutdown()
