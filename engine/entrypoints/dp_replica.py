"""``EngineReplica``: one data-parallel replica, the body of a Ray actor.

It owns one ``AsyncLLM`` (its own engine thread, model and grammar cache) and serves it over
Ray: ``add`` validates and queues a request, ``stream`` yields its outputs (a Ray streaming
generator), ``abort`` ends one. Ray is not imported here: ``DataParallelLLM`` wraps the class
with ``ray.remote`` where Ray is installed, so this module imports without it.
"""

from __future__ import annotations

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
        self._streams: dict[str, RequestStream] = {}

    def info(self) -> dict[str, Any]:
        """What the front end needs from a replica: its pid and model limits; also the
        readiness probe after a restart."""
        return {
            "pid": os.getpid(),
            "max_model_len": self._engine.max_model_len,
            "sampling_defaults": self._engine.sampling_defaults(),
        }

    async def add(self, prompt: Prompt, params: SamplingParams, request_id: str) -> None:
        """Validates and queues a request (``AsyncLLM.add_request``'s errors, as they are)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = await self._engine.add_request(prompt, params, request_id)

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields the outputs of a request ``add`` queued, until its final one. Cancelling
        the Ray task (the front end's consumer went away) aborts the request."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no request {request_id!r} on replica {self.index}")
        try:
            async for out in stream:
                yield out
        finally:
            self._streams.pop(request_id, None)
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Aborts a request, also one whose stream was never asked for; unknown ids are
        ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()
        await self._engine.abort(request_id)

    def stats(self) -> dict[str, float | int | str]:
        """The engine's ``stats()``, plus ``healthy`` (1/0) and ``pid``."""
        stats = self._engine.stats()
        stats["healthy"] = int(self._engine.is_healthy())
        stats["pid"] = os.getpid()
        return stats

    def shutdown(self) -> None:
        """Stops the engine (its open streams fail)."""
        self._engine.shutdown()
